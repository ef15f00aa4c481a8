"""Rotary position embeddings: the tables (cos, sin) for a step's positions, and applying them to q/k heads.

One `RotaryEmbedding` per model; every layer applies the same tables. `rotary_dim` may be smaller than the head
(partial rotary, e.g. GLM-4.5, or DeepSeek's MLA where only the `qk_rope_head_dim` part rotates): then the first
`rotary_dim` dims of each head rotate and the rest pass through, as in `transformers`.
"""

from __future__ import annotations

import math

import torch

from .config import MoEModelConfig, YarnScaling


class RotaryEmbedding:
    """cos/sin tables in Hugging Face's layout: emb = cat(freqs, freqs) over the rotary dims."""

    def __init__(self, rotary_dim: int, theta: float, inv_freq: torch.Tensor | None = None,
                 attention_scaling: float = 1.0, device: torch.device | str = "cpu"):
        self.rotary_dim = rotary_dim
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.inv_freq = inv_freq.to(device)  # [R/2]
        # Scaled RoPE variants (YaRN) multiply cos and sin by a constant, as transformers does.
        self.attention_scaling = attention_scaling

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos [T, R], sin [T, R]) in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, n, d]; cos/sin: [T, R] with R <= d -> x with its first R dims of every head rotated."""
    rotary = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1·mscale·ln(scale) + 1 (1 when the context is not extended)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(rotary_dim: int, theta: float, yarn: YarnScaling) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [R/2], attention_factor) as transformers' `_compute_yarn_parameters`: high-frequency dims keep
    their frequency (extrapolation), low-frequency dims are divided by `factor` (interpolation), with a linear ramp
    between the dims that turn `beta_fast` and `beta_slow` times over the original context; cos and sin are then
    scaled by the attention factor (which also scales the softmax logits, by its square)."""
    factor = yarn.factor
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, yarn.mscale) / yarn_mscale(factor, yarn.mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the original context
        return (rotary_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                ) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [R/2]
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).to(dtype=torch.float) / rotary_dim)  # [R/2]
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def build_rope(cfg: MoEModelConfig, device: torch.device | str = "cpu") -> RotaryEmbedding:
    """The model's rotary embedding, from its config (families with scaled RoPE add their variant here)."""
    if cfg.rope_yarn is not None:
        inv_freq, attention_factor = yarn_parameters(cfg.head_dim, cfg.rope_theta, cfg.rope_yarn)
        return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, inv_freq=inv_freq, attention_scaling=attention_factor,
                               device=device)
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device=device)
