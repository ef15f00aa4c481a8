"""YaRN RoPE scaling as transformers computes it (modeling_rope_utils._compute_yarn_parameters), the MLA softmax
scale with DeepSeek's mscale, and the pair-interleaved rotation DeepSeek uses. Pure torch.
"""

from __future__ import annotations

import math

import torch

from .config_deepseek import YarnScaling


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, yarn: YarnScaling) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dim/2] float32, attention_factor: the factor cos and sin are multiplied by)."""
    factor = yarn.factor
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, yarn.mscale) / yarn_get_mscale(factor, yarn.mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim/2]
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)  # [dim/2]
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the unscaled frequency per dim
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def mla_softmax_scale(qk_head_dim: int, yarn: YarnScaling | None) -> float:
    """1/sqrt(d_qk), times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale)."""
    scale = qk_head_dim ** -0.5
    if yarn is not None and yarn.mscale_all_dim:
        m = yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
        scale = scale * m * m
    return scale


def apply_rotary_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE: dims (x0, x1), (x2, x3), .. rotate as pairs. x [T, n, R], cos/sin [T, R] in the
    cat(freqs, freqs) layout. The result is de-interleaved (rotated evens, then rotated odds), as transformers'
    DeepSeek-V3 writes it; since queries and keys get the same permutation, q.k equals the interleaved form
    (DeepSeek-V2's complex multiply) up to float rounding."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [T, 1, R/2]
    even, odd = x[..., 0::2], x[..., 1::2]  # [T, n, R/2]
    return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)  # [T, n, R]
