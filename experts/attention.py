"""Attention layers per family: what a token's q, k and v are, what it stores in the KV cache, and the output
projection. The math over the history is experts/attention_core.py; the decoder (experts/modeling.py) wires the
two through the cache.

Every layer implements `AttentionLayer`. A family with a different attention (DeepSeek's MLA) adds its own class
and a branch in `build_attention`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .attention_core import default_scale
from .config import MoEModelConfig
from .dense_weights import AttentionWeights
from .norms import rms_norm
from .rope import apply_rotary, apply_rotary_interleaved


class AttentionLayer(Protocol):
    num_heads: int  # query heads
    num_kv_heads: int  # heads of k/v as the core sees them (GQA: kvh; MLA expanded: nh)
    scale: float  # softmax scale
    window: int | None  # sliding window (keys with q_pos - k_pos < window), None = all
    chunk: int | None  # attention chunk (keys with k_pos // chunk == q_pos // chunk; Llama 4), None = all
    sinks: torch.Tensor | None  # [nh] per-head extra softmax logit, None = none
    cache_spec: dict[str, tuple[int, ...]]  # what one token stores in the KV cache: name -> per-token shape

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """h [T, H], cos/sin [T, R] -> (q [T, nh, Dqk], {name: [T, *shape]} to append to the cache). A layer that
        sets `wants_positions` (Llama 4) also takes the tokens' positions [T] int64 as a fourth argument."""
        ...

    def keys_values(self, entries: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached entries {name: [..., L, *shape]} -> (k [..., L, kvh, Dqk], v [..., L, kvh, Dv])."""
        ...

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o [T, nh*Dv] -> [T, H]."""
        ...


class GQAAttention:
    """Grouped-query attention with RoPE (Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE, gpt-oss, GLM-4.5, MiniMax-M2,
    ERNIE 4.5, Hunyuan): optional q/k/v bias, OLMoE's / MiniMax-M2's RMSNorm over the projected q and k (full
    width), Qwen3-MoE's RMSNorm over each q and k head (head_dim, before RoPE; Hunyuan's after RoPE), OLMoE's
    clip_qkv, gpt-oss's attention sinks and o_proj bias, ERNIE's pair-interleaved RoPE. Caches rotated keys and
    values."""

    def __init__(self, cfg: MoEModelConfig, w: AttentionWeights, window: int | None):
        self.w = w
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.clip = cfg.clip_qkv
        self.qk_norm_per_head = cfg.qk_norm_per_head  # Qwen3-MoE, GLM-4.5: q_norm/k_norm weights are [D], per head
        self.norm_after_rope = cfg.qk_norm_after_rope  # Hunyuan: that per-head norm runs on the rotated q and k
        self.rotate = apply_rotary_interleaved if cfg.rope_pairs_interleaved else apply_rotary  # ERNIE: interleaved
        self.scale = default_scale(cfg.head_dim)
        self.window = window
        self.chunk = None
        self.sinks = w.sinks  # [nh] or None
        self.cache_spec = {"k": (cfg.num_kv_heads, cfg.head_dim), "v": (cfg.num_kv_heads, cfg.head_dim)}

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        w = self.w
        q = F.linear(h, w.q, w.q_bias)  # [T, nh*D]
        k = F.linear(h, w.k, w.k_bias)  # [T, kvh*D]
        v = F.linear(h, w.v, w.v_bias)  # [T, kvh*D]
        if w.q_norm is not None and not self.qk_norm_per_head:
            q = rms_norm(q, w.q_norm, self.eps)
            k = rms_norm(k, w.k_norm, self.eps)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, nh, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, kvh, D]
        if self.qk_norm_per_head and not self.norm_after_rope:
            q, k = rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)
        q = self.rotate(q, cos, sin)  # [T, nh, D]
        k = self.rotate(k, cos, sin)  # [T, kvh, D]
        if self.norm_after_rope:
            q, k = rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)
        return q, {"k": k, "v": v.view(-1, self.num_kv_heads, self.head_dim)}

    def keys_values(self, entries: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return entries["k"], entries["v"]

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return F.linear(o, self.w.o, self.w.o_bias)  # [T, H]


def build_attention(cfg: MoEModelConfig, layer: int, w: AttentionWeights) -> AttentionLayer:
    """The attention layer of model layer `layer`."""
    if cfg.is_linear_layer(layer):  # a state instead of a KV history
        if cfg.family == "kimi_linear":  # Kimi Delta Attention: per-channel decay
            from .kda import KimiDeltaAttention

            return KimiDeltaAttention(cfg, w)
        from .gated_delta import GatedDeltaNet  # Qwen3-Next / Qwen3.5

        return GatedDeltaNet(cfg, w)
    if cfg.attention_kind == "mla" and cfg.index_n_heads:  # DeepSeek-V3.2 / GLM-5: MLA + DSA top-k
        from .dsa_indexer import DSAAttention

        return DSAAttention(cfg, w)
    if cfg.attention_kind == "mla":  # DeepSeek-V2/V3, Kimi-Linear (without RoPE)
        from .mla_attention import MLAAttention

        return MLAAttention(cfg, w)
    if cfg.family == "mimo_v2_flash":  # per-kind KV heads and RoPE base, narrower scaled values, sinks on SWA
        from .attention_mimo import MiMoAttention

        return MiMoAttention(cfg, w, layer)
    if cfg.family == "llama4":  # chunked RoPE layers, NoPE layers with temperature, q/k L2 norm
        from .attention_llama4 import Llama4Attention

        return Llama4Attention(cfg, w, layer)
    if cfg.attn_output_gate:  # Qwen3-Next / Qwen3.5 full attention: sigmoid output gate, zero-centred q/k norm
        from .attention_qwen3_next import GatedAttention

        return GatedAttention(cfg, w)
    window = cfg.sliding_window if layer in cfg.sliding_layers else None
    return GQAAttention(cfg, w, window)
