"""Multi-head Latent Attention (DeepSeek-V2/V3), as an attention layer of the decoder (AttentionLayer protocol).

What the KV cache stores per token is what MLA needs, not per-head keys and values: the normalised compressed
latent c_kv [r] and the rope'd key part k_rot [d_rope] that all heads share, one vector of r + d_rope values
(`cache_spec = {"latent": (r + d_rope,)}`; DeepSeek-V3: 512 + 64 = 576 per token and layer instead of
2 * 128 heads * 128 = 32768). `keys_values` expands the cached latents with kv_b_proj into per-head keys
[k_nope | k_rot] and values when attention runs: the "naive" formulation, the same arithmetic as transformers, so
logits match it to float rounding. (The absorbed formulation — folding kv_b_proj into the query and the output and
attending over the latents directly — saves that expansion at decode time; it is left for later.)

Math (transformers' DeepseekV3Attention):
  q       = q_proj(h)  or  q_b_proj(rms(q_a_proj(h)))                     [T, nh, d_nope + d_rope]
  c, k_r  = split(kv_a_proj_with_mqa(h), [r, d_rope]); c = rms(c)        [T, r], [T, d_rope]
  q_rot, k_r rotated (pairs for DeepSeek), k = [kv_b(c)_nope | k_r], v = kv_b(c)_v
  softmax scale = d_qk^-0.5 * mscale(factor, mscale_all_dim)^2 under YaRN.
  LongCat-Flash (cfg.mla_lora_scale): q x sqrt(H / q_lora_rank) before RoPE and c x sqrt(H / r) after its norm
  (so the cache holds the scaled latent), as transformers' LongcatFlashMLA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MoEModelConfig
from .rope_yarn import apply_rotary_pairs, mla_softmax_scale
from .weights_deepseek import MLAWeights

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps, not rms_norm_eps


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half_layout(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE (DeepSeek-V3 with rope_interleave false). x [T, n, R], cos/sin [T, R]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _unrotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x


class MLAAttention:
    """One MLA layer. num_kv_heads = num_heads: the core sees the expanded per-head keys and values."""

    window = None
    chunk = None
    sinks = None

    def __init__(self, cfg: MoEModelConfig, w: MLAWeights):
        self.w = w
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_heads
        self.d_nope, self.d_rope, self.d_v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.scale = mla_softmax_scale(self.d_nope + self.d_rope, cfg.yarn)
        self.cache_spec: dict[str, tuple[int, ...]] = {"latent": (self.rank + self.d_rope,)}
        self._rotate = apply_rotary_pairs if cfg.rope_pairs_interleaved else _rotate_half_layout
        # LongCat's LoRA scaling (python floats, as transformers multiplies by them); None: no scaling
        self.lora_scales = ((cfg.hidden_size / cfg.q_lora_rank) ** 0.5, (cfg.hidden_size / self.rank) ** 0.5) \
            if cfg.mla_lora_scale else None
        if not cfg.mla_rope:  # Kimi-Linear: the d_rope part is kept (the key part shared by all heads), not rotated
            self._rotate = _unrotated

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [T, H], cos/sin [T, d_rope] -> (q [T, nh, d_qk], {"latent": [T, r + d_rope]})."""
        w, nh = self.w, self.num_heads
        if w.q is not None:
            q = F.linear(h, w.q)  # [T, nh*d_qk]
        else:
            q = F.linear(_rms(F.linear(h, w.q_a, w.q_a_bias), w.q_a_norm, LORA_NORM_EPS), w.q_b)  # [T, nh*d_qk]
        q = q.view(h.shape[0], nh, self.d_nope + self.d_rope)  # [T, nh, d_qk]
        if self.lora_scales is not None:
            q = q * self.lora_scales[0]
        q_nope, q_rot = q.split([self.d_nope, self.d_rope], dim=-1)
        compressed = F.linear(h, w.kv_a, w.kv_a_bias)  # [T, r + d_rope]
        latent, k_rot = compressed.split([self.rank, self.d_rope], dim=-1)
        latent = _rms(latent, w.kv_a_norm, LORA_NORM_EPS)  # [T, r]
        if self.lora_scales is not None:
            latent = latent * self.lora_scales[1]
        k_rot = self._rotate(k_rot[:, None, :], cos, sin)[:, 0]  # [T, d_rope]
        q = torch.cat([q_nope, self._rotate(q_rot, cos, sin)], dim=-1)  # [T, nh, d_qk]
        return q, {"latent": torch.cat([latent, k_rot], dim=-1)}  # [T, r + d_rope]

    def keys_values(self, entries: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """{"latent": [..., L, r + d_rope]} -> (k [..., L, nh, d_qk], v [..., L, nh, d_v])."""
        cached = entries["latent"]
        latent, k_rot = cached.split([self.rank, self.d_rope], dim=-1)  # [..., L, r], [..., L, d_rope]
        kv = F.linear(latent, self.w.kv_b)  # [..., L, nh*(d_nope + d_v)]
        kv = kv.view(*kv.shape[:-1], self.num_heads, self.d_nope + self.d_v)  # [..., L, nh, d_nope + d_v]
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)
        k_rot = k_rot[..., None, :].expand(*k_nope.shape[:-1], self.d_rope)  # [..., L, nh, d_rope]
        return torch.cat([k_nope, k_rot], dim=-1), v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o [T, nh*d_v] -> [T, H]."""
        return F.linear(o, self.w.o, self.w.o_bias)


class AbsorbedMLAAttention(MLAAttention):
    """MLA with kv_b_proj absorbed: the same cache entry, attended as multi-query attention over the latents.

    q_nope·k_nope = q_nope·(W_UK c) = (q_nope W_UK)·c, so each head's query is mapped into the latent space once
    ([T, nh, r], then [q_lat | q_rot]) and every head attends over the cached [c | k_rot] (one shared key head of
    r + d_rope values, the value being c itself); the output maps back per head with W_UV. Nothing is expanded per
    cached token, so a decode step costs O(L·nh·(2r + d_rope)) instead of O(L·r·nh·(d_nope + d_v)) for the
    expansion (DeepSeek-V3 at L = 4096: ~0.6 GFLOP instead of ~69 GFLOP per layer and sequence); for a long prefill
    the expanded form is cheaper. Same math as `MLAAttention` in another summation order (tests: ≤ 1e-5 in fp32).
    """

    def __init__(self, cfg: MoEModelConfig, w: MLAWeights):
        super().__init__(cfg, w)
        self.num_kv_heads = 1  # one latent "head" shared by every query head
        kv_b = w.kv_b.view(self.num_heads, self.d_nope + self.d_v, self.rank)  # [nh, d_nope + d_v, r]
        self.w_uk = kv_b[:, : self.d_nope]  # [nh, d_nope, r]
        self.w_uv = kv_b[:, self.d_nope:]  # [nh, d_v, r]

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [T, H] -> (q [T, nh, r + d_rope] in the latent space, {"latent": [T, r + d_rope]})."""
        q, entries = super().project(h, cos, sin)  # q [T, nh, d_nope + d_rope]
        q_nope, q_rot = q.split([self.d_nope, self.d_rope], dim=-1)
        q_lat = torch.einsum("tnd,ndr->tnr", q_nope, self.w_uk)  # [T, nh, r]
        return torch.cat([q_lat, q_rot], dim=-1), entries

    def keys_values(self, entries: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """{"latent": [..., L, r + d_rope]} -> (k [..., L, 1, r + d_rope], v [..., L, 1, r])."""
        cached = entries["latent"][..., None, :]  # [..., L, 1, r + d_rope]
        return cached, cached[..., : self.rank]

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o [T, nh*r] (attention over latents) -> [T, H]."""
        o = torch.einsum("tnr,nvr->tnv", o.view(o.shape[0], self.num_heads, self.rank), self.w_uv)  # [T, nh, d_v]
        return F.linear(o.reshape(o.shape[0], -1), self.w.o, self.w.o_bias)
