"""The attention math over cached history: scaled dot-product attention with causal masking, an optional sliding
window and optional attention sinks, for a prefilling sequence or a batch of decoding ones.

Attention *layers* (experts/attention.py, per family) decide what q, k and v are; this module only attends.
Without sinks it calls `F.scaled_dot_product_attention` (fused kernels where eligible). With sinks (gpt-oss: a
learned per-head logit that joins every row's softmax and attends to nothing) it computes the softmax itself, the
way `transformers` does, since SDPA has no such term.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def default_scale(head_dim: int) -> float:
    """1/sqrt(d), computed as SDPA computes its default (so passing it changes no bit)."""
    return 1.0 / math.sqrt(head_dim)


def attend_prefill(
    q: torch.Tensor,  # [S, nh, Dqk] the sequence's new queries
    k: torch.Tensor,  # [L, kvh, Dqk] its whole history, L = start + S
    v: torch.Tensor,  # [L, kvh, Dv]
    start: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [nh]
) -> torch.Tensor:
    """Attention of one sequence's S new tokens at positions start..start+S-1 -> [S, nh*Dv]."""
    num_new = q.shape[0]
    mask = prefill_mask(num_new, start, window, q.device)
    out = _sdpa(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # [nh, S, Dqk], [kvh, L, Dqk], [kvh, L, Dv]
        mask, mask is None and start == 0 and num_new > 1, scale, sinks,
    )  # [nh, S, Dv]
    return out.transpose(0, 1).reshape(num_new, -1)


def attend_decode(
    q: torch.Tensor,  # [B, nh, Dqk] one query per sequence
    k: torch.Tensor,  # [B, L, kvh, Dqk] histories padded to the longest
    v: torch.Tensor,  # [B, L, kvh, Dv]
    lengths: torch.Tensor,  # [B] int64 real history length of each row (its new token included)
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [nh]
) -> torch.Tensor:
    """One attention call for B sequences that each add a single token -> [B, nh*Dv]. Padding is masked out."""
    positions = torch.arange(k.shape[1], device=q.device)[None, :]  # [1, L]
    mask = positions < lengths[:, None]  # [B, L]: a real position
    if window is not None:
        mask &= (lengths[:, None] - 1 - positions) < window  # within the window of the query at length-1
    out = _sdpa(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),  # [B, nh, 1, Dqk], [B, kvh, L, Dqk], [B, kvh, L, Dv]
        mask[:, None, None, :], False, scale, sinks,
    )  # [B, nh, 1, Dv]
    return out.reshape(q.shape[0], -1)


def prefill_mask(num_new: int, start: int, window: int | None, device: torch.device | str = "cpu"
                 ) -> torch.Tensor | None:
    """Boolean [S, start+S] mask (True = attend), or None when plain causal (or no) masking is exact."""
    if window is None and (start == 0 or num_new == 1):
        return None  # is_causal covers a fresh prefill; a single new token attends to everything before it
    q_pos = torch.arange(start, start + num_new, device=device)[:, None]
    k_pos = torch.arange(start + num_new, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
          scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [..., nh, S, Dqk], k [..., kvh, L, Dqk], v [..., kvh, L, Dv] -> [..., nh, S, Dv]."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=heads != kv_heads)
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=-3)
        v = v.repeat_interleave(heads // kv_heads, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., nh, S, L]
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)  # [..., nh, S, 1]
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)  # as transformers: stable with fully masked rows
    probs = torch.softmax(combined, dim=-1)[..., :-1]  # the sink's share attends to nothing
    return torch.matmul(probs.to(v.dtype), v)
