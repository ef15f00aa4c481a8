"""Expert feed-forward math (SwiGLU-style gated MLP), shared by the actors and the in-process reference."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .quant import QuantizedLinear, linear, tensor_nbytes
from .reproducible import aligned


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
    """One gated MLP. gate and up are fused so an expert costs two matmuls, not three.

    kind "gated": down(act(gate) * up). kind "clamped_swiglu" (gpt-oss): gate clamped to ≤ limit, up to ±limit,
    down(gate·σ(alpha·gate)·(up + 1)); `act` is not used. Biases are optional (gpt-oss has them).

    gate_up and down are tensors, or QuantizedLinear (experts/quant.py, `experts.quant`) of the same [out, in]
    shape; `.to` and `.nbytes` cover both (a quantised weight's bytes are its packed integers plus scales)."""

    gate_up: torch.Tensor | QuantizedLinear  # [2I, H]: the I gate rows, then the I up rows
    down: torch.Tensor | QuantizedLinear  # [H, I]
    gate_up_bias: torch.Tensor | None = None  # [2I]
    down_bias: torch.Tensor | None = None  # [H]
    kind: str = "gated"
    alpha: float = 1.702  # clamped_swiglu only
    limit: float = 7.0  # clamped_swiglu only

    @classmethod
    def from_parts(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, **extra) -> GatedMLPWeights:
        return cls(gate_up=torch.cat([gate, up], dim=0).contiguous(), down=down.contiguous(), **extra)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None,
           non_blocking: bool = False) -> GatedMLPWeights:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype, non_blocking=non_blocking)

        return dataclasses.replace(self, gate_up=move(self.gate_up), down=move(self.down),
                                   gate_up_bias=move(self.gate_up_bias), down_bias=move(self.down_bias))

    def nbytes(self) -> int:
        return sum(tensor_nbytes(t) for t in (self.gate_up, self.down, self.gate_up_bias, self.down_bias))

    def aligned(self) -> GatedMLPWeights:
        """The same weights with each float matrix on a 64-byte boundary (experts/reproducible.py: a one-row product's
        bits depend on where its weight starts); quantised matrices are fresh allocations already."""
        def align(t):
            return aligned(t) if isinstance(t, torch.Tensor) else t

        return dataclasses.replace(self, gate_up=align(self.gate_up), down=align(self.down))

    @property
    def quant(self) -> str:
        """The experts.quant mode its matrices are stored in ("none": plain tensors)."""
        return self.gate_up.mode if isinstance(self.gate_up, QuantizedLinear) else "none"


# at::internal::GRAIN_SIZE: torch runs a CPU elementwise op of fewer elements on one thread.
PARALLEL_GRAIN = 32768


def gated_mlp(x: torch.Tensor, w: GatedMLPWeights, act) -> torch.Tensor:
    """down(act(gate(x)) * up(x)), or gpt-oss's clamped SwiGLU for kind "clamped_swiglu".  x: [T, H] -> [T, H]."""
    if w.kind == "clamped_swiglu":
        gate, up = linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)  # [T, I] each
        gate = gate.clamp(max=w.limit)
        up = up.clamp(min=-w.limit, max=w.limit)
        return linear((up + 1) * (gate * torch.sigmoid(gate * w.alpha)), w.down, w.down_bias)  # [T, H]
    return linear(gated_activation(linear(x, w.gate_up, w.gate_up_bias), act), w.down, w.down_bias)  # [T, H]


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
