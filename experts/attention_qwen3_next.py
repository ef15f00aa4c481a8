"""Qwen3-Next / Qwen3.5's full-attention layers (transformers' Qwen3NextAttention): GQA whose `q_proj` packs, per
head, the D query rows and then D rows of an output gate; per-head q/k RMSNorm with zero-centred weights
(x * (1 + w)); RoPE on the first `rotary_dim` dims of each head (partial_rotary_factor); the attention output is
multiplied by sigmoid(gate) before `o_proj`. The attention math is experts/attention_core.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MoEModelConfig
from .dense_weights import AttentionWeights
from .norms import rms_norm_unit_offset
from .rope import apply_rotary


class GatedAttention:
    """One gated full-attention layer (experts/attention.py `AttentionLayer`)."""

    def __init__(self, cfg: MoEModelConfig, w: AttentionWeights):
        self.w = w
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.window = self.chunk = self.sinks = None
        self.scale = cfg.head_dim ** -0.5
        self.cache_spec = {"k": (cfg.num_kv_heads, cfg.head_dim), "v": (cfg.num_kv_heads, cfg.head_dim)}
        # The gate of the rows `project` last saw, for `output`: the decoder calls project, the core and output for
        # one group in a row (modeling.py `_attention`), so nothing runs in between that could overwrite it.
        self._gate: torch.Tensor | None = None

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """h [T, H], cos/sin [T, R] -> (q [T, nh, D], {"k", "v": [T, kvh, D]}); keeps the gate [T, nh*D]."""
        w, d = self.w, self.head_dim
        packed = F.linear(h, w.q, w.q_bias).view(-1, self.num_heads, 2 * d)  # [T, nh, 2D]
        q, gate = packed[..., :d], packed[..., d:]
        self._gate = gate.reshape(h.shape[0], -1)  # [T, nh*D]
        q = rms_norm_unit_offset(q, w.q_norm, self.eps)
        k = rms_norm_unit_offset(F.linear(h, w.k, w.k_bias).view(-1, self.num_kv_heads, d), w.k_norm, self.eps)
        v = F.linear(h, w.v, w.v_bias).view(-1, self.num_kv_heads, d)  # [T, kvh, D]
        return apply_rotary(q, cos, sin), {"k": apply_rotary(k, cos, sin), "v": v}

    def keys_values(self, entries: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return entries["k"], entries["v"]

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o [T, nh*D] -> o_proj(o * sigmoid(gate)) [T, H]."""
        gate, self._gate = self._gate, None
        return F.linear(o * torch.sigmoid(gate), self.w.o, self.w.o_bias)  # [T, H]
