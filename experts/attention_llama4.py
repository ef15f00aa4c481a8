"""Llama 4's attention layer (transformers' Llama4TextAttention): GQA whose RoPE layers rotate (x0, x1), (x2, x3)
pairs in float32, L2-normalise q and k after RoPE (`use_qk_norm`, no weight) and attend within chunks of
`attention_chunk_size` tokens; whose NoPE layers attend to the whole history with the query scaled per position
(attention temperature tuning). The attention math is experts/attention_core.py's (its `chunk` mask).

Its `project` takes the tokens' positions too (the temperature depends on them): the decoder passes them to layers
that set `wants_positions`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MoEModelConfig
from .dense_weights import AttentionWeights
from .rope import apply_rotary_interleaved


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama4TextL2Norm: x / rms(x) over the last dim, in float32, cast back (no weight). x: [..., d]."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temperature_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """positions [T] int64 -> [T] float32: log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, the NoPE layers'
    query scale (1 for every position below floor_scale - 1)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class Llama4Attention:
    """One Llama 4 layer's attention (experts/attention.py `AttentionLayer`, plus positions in `project`)."""

    wants_positions = True

    def __init__(self, cfg: MoEModelConfig, w: AttentionWeights, layer: int):
        self.w = w
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.rope = layer not in cfg.nope_layers
        self.l2 = cfg.qk_l2_norm and self.rope  # transformers builds qk_norm on RoPE layers only
        self.temperature = cfg.attn_temperature if not self.rope else None  # (floor_scale, attn_scale)
        self.chunk = cfg.attention_chunk_size if layer in cfg.chunked_layers else None
        self.window = None
        self.sinks = None
        self.scale = cfg.head_dim ** -0.5  # transformers' self.scaling, the same float
        self.cache_spec = {"k": (cfg.num_kv_heads, cfg.head_dim), "v": (cfg.num_kv_heads, cfg.head_dim)}

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """h [T, H], cos/sin [T, D] float32, positions [T] -> (q [T, nh, D], {"k", "v": [T, kvh, D]})."""
        w = self.w
        q = F.linear(h, w.q, w.q_bias).view(-1, self.num_heads, self.head_dim)  # [T, nh, D]
        k = F.linear(h, w.k, w.k_bias).view(-1, self.num_kv_heads, self.head_dim)  # [T, kvh, D]
        v = F.linear(h, w.v, w.v_bias).view(-1, self.num_kv_heads, self.head_dim)  # [T, kvh, D]
        if self.rope:
            q, k = apply_rotary_interleaved(q, cos, sin), apply_rotary_interleaved(k, cos, sin)
        if self.l2:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature is not None:
            scales = temperature_scales(positions, *self.temperature)  # [T] float32
            q = (q * scales[:, None, None]).to(q.dtype)  # as transformers: the product in float32, cast back
        return q, {"k": k, "v": v}

    def keys_values(self, entries: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return entries["k"], entries["v"]

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return F.linear(o, self.w.o, self.w.o_bias)  # [T, H]
