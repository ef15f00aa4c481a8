"""Rotary position embeddings: the tables (cos, sin) for a step's positions, and applying them to q/k heads.

One `RotaryEmbedding` per model; every layer applies the same tables. `rotary_dim` may be smaller than the head
(partial rotary, e.g. GLM-4.5, or DeepSeek's MLA where only the `qk_rope_head_dim` part rotates): then the first
`rotary_dim` dims of each head rotate and the rest pass through, as in `transformers`.
"""

from __future__ import annotations

import math

import torch

from .config import Llama3Scaling, MoEModelConfig


class RotaryEmbedding:
    """cos/sin tables in Hugging Face's layout: emb = cat(freqs, freqs) over the rotary dims."""

    def __init__(self, rotary_dim: int, theta: float, inv_freq: torch.Tensor | None = None,
                 attention_scaling: float = 1.0, device: torch.device | str = "cpu",
                 float32_tables: bool = False):
        """float32_tables: tables() returns float32 whatever the model dtype (Llama 4 rotates in float32 with
        float32 cos/sin, as transformers' complex form does)."""
        self.rotary_dim = rotary_dim
        self.float32_tables = float32_tables
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
        if self.float32_tables:
            return cos, sin
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


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """ERNIE 4.5's RoPE: dims (x0, x1), (x2, x3), .. rotate as pairs in place (frequency i on pair i), computed in
    float32 and cast back, as transformers' Ernie4_5 apply_rotary_pos_emb. x: [T, n, d]; cos/sin: [T, d] in the
    cat(freqs, freqs) layout."""
    half = cos.shape[-1] // 2
    c = cos[:, None, :half].repeat_interleave(2, dim=-1).float()  # [T, 1, d]: f0, f0, f1, f1, ..
    s = sin[:, None, :half].repeat_interleave(2, dim=-1).float()
    x32 = x.float()
    rotated = torch.stack((-x32[..., 1::2], x32[..., 0::2]), dim=-1).flatten(-2)  # (-x1, x0, -x3, x2, ..)
    return (x32 * c + rotated * s).to(x.dtype)


def llama3_inv_freq(dim: int, theta: float, scaling: Llama3Scaling) -> torch.Tensor:
    """rope_type "llama3" (transformers' _compute_llama3_parameters, the same float32 steps): long wavelengths
    divided by `factor`, short ones kept, the band between interpolated. -> inv_freq [dim/2] float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def build_rope(cfg: MoEModelConfig, device: torch.device | str = "cpu") -> RotaryEmbedding:
    """The model's rotary embedding, from its config (families with scaled RoPE add their variant here)."""
    if cfg.family == "llama4":
        inv_freq = None if cfg.llama3_rope is None else llama3_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.llama3_rope)
        return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, inv_freq, device=device, float32_tables=True)
    if cfg.rotary_dim or cfg.yarn is not None:  # DeepSeek (MLA rope part, YaRN), GLM-4.5 (partial rotary)
        from .rope_yarn import yarn_inv_freq

        dim = cfg.rotary_dim or cfg.head_dim
        inv_freq, scaling = yarn_inv_freq(dim, cfg.rope_theta, cfg.yarn) if cfg.yarn is not None else (None, 1.0)
        return RotaryEmbedding(dim, cfg.rope_theta, inv_freq, scaling, device=device)
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device=device)
