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


# at::internal::GRAIN_SIZE: torch runs a CPU elementwise op of fewer elements on one thread.
PARALLEL_GRAIN = 32768


def gated_mlp(x: torch.Tensor, w: GatedMLPWeights, act) -> torch.Tensor:
    """down(act(gate(x)) * up(x)).  x: [T, H] -> [T, H]."""
    return F.linear(gated_activation(F.linear(x, w.gate_up), act), w.down)  # [T, H]


def gated_activation(h: torch.Tensor, act) -> torch.Tensor:
    """h: [T, 2I] = [gate | up] -> act(gate) * up, [T, I].

    On CPU in blocks of whole rows below torch's parallel grain: torch's elementwise kernels compute full SIMD
    vectors with vector code and a leftover tail with scalar code (their exp can differ in the last bit), and where
    the tail falls depends on how the op is split over threads, i.e. on the tensor's total size. In blocks, each row
    takes the same path however many rows share the call (other experts' rows, other replicas' chunks) and however
    many threads run, so the reference and the actors agree bit for bit.
    """
    gate, up = h.chunk(2, dim=-1)  # [T, I] each
    block = max(1, PARALLEL_GRAIN // max(1, gate.shape[1]))
    if h.device.type != "cpu" or h.shape[0] <= block:
        return act(gate) * up
    return torch.cat([act(g) * u for g, u in zip(gate.split(block), up.split(block))])
