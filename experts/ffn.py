"""Expert feed-forward math (SwiGLU-style gated MLP), shared by the actors and the in-process reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def activation(name: str):
    """The gate activation named by `hidden_act` in config.json."""
    if name in ("silu", "swish"):
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"hidden_act={name!r} is not supported")


@dataclass
class GatedMLPWeights:
    """One gated MLP. gate and up are fused so an expert costs two matmuls, not three."""

    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]

    @classmethod
    def from_parts(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> GatedMLPWeights:
        return cls(gate_up=torch.cat([gate, up], dim=0).contiguous(), down=down.contiguous())

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> GatedMLPWeights:
        return GatedMLPWeights(self.gate_up.to(device=device, dtype=dtype), self.down.to(device=device, dtype=dtype))

    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()


def gated_mlp(x: torch.Tensor, w: GatedMLPWeights, act) -> torch.Tensor:
    """down(act(gate(x)) * up(x)).  x: [T, H] -> [T, H]."""
    gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)  # [T, I] each
    return F.linear(act(gate) * up, w.down)  # [T, H]
