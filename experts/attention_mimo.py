"""MiMo-V2-Flash's attention layer (transformers' MiMoV2FlashAttention): GQA with partial RoPE whose base depends on
the layer's kind, values `v_head_dim` wide scaled by `attention_value_scale` before they are cached, and on sliding
layers twice the KV heads, a window and learned per-head sinks. The math over the history is
experts/attention_core.py's (window mask, sinks softmax).

Each layer holds its own rotary tables' source (full and sliding layers rotate with different bases), so it takes the
tokens' positions (`wants_positions`) and ignores the decoder's shared tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MoEModelConfig
from .dense_weights import AttentionWeights
from .rope import RotaryEmbedding, apply_rotary


class MiMoAttention:
    """One MiMo-V2-Flash layer's attention (experts/attention.py `AttentionLayer`, plus positions in `project`)."""

    wants_positions = True
    chunk = None

    def __init__(self, cfg: MoEModelConfig, w: AttentionWeights, layer: int):
        self.w = w
        sliding = layer in cfg.sliding_layers
        self.num_heads, self.head_dim, self.v_dim = cfg.num_heads, cfg.head_dim, cfg.v_head_dim
        self.num_kv_heads = cfg.kv_heads(layer)
        self.window = cfg.sliding_window if sliding else None
        self.sinks = w.sinks if sliding else None  # [nh]
        theta = cfg.sliding_rope_theta if sliding and cfg.sliding_rope_theta is not None else cfg.rope_theta
        self.rope = RotaryEmbedding(cfg.rotary_dim, theta, device=w.q.device)
        self.value_scale = cfg.attention_value_scale
        self.scale = cfg.head_dim ** -0.5  # transformers' self.scaling (q/k head_dim), the same float
        self.cache_spec = {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.v_dim)}

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """h [T, H], positions [T] -> (q [T, nh, D], {"k": [T, kvh, D], "v": [T, kvh, Dv]}); the decoder's cos/sin
        are not used (this layer's base may differ)."""
        w = self.w
        cos, sin = self.rope.tables(positions, h.dtype)  # [T, R]
        q = F.linear(h, w.q, w.q_bias).view(-1, self.num_heads, self.head_dim)  # [T, nh, D]
        k = F.linear(h, w.k, w.k_bias).view(-1, self.num_kv_heads, self.head_dim)  # [T, kvh, D]
        v = F.linear(h, w.v, w.v_bias).view(-1, self.num_kv_heads, self.v_dim) * self.value_scale  # [T, kvh, Dv]
        return apply_rotary(q, cos, sin), {"k": apply_rotary(k, cos, sin), "v": v}

    def keys_values(self, entries: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return entries["k"], entries["v"]

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return F.linear(o, self.w.o)  # [T, H]; o_proj has no bias
