"""The attention math of a step over the paged KV cache: batched decode, batched (chunked) prefill.

A step's sequences fall into two groups, each attended in one 4-D call:
- decode rows (one new token after some history): their histories are gathered from the pool through one padded
  block table ([B, nb] -> [B, L, ...]) and masked by length (and window);
- prefill rows (several new tokens: a prompt, or a chunk of one after `start` earlier tokens): their queries are
  padded to the longest ([B, S, ...]); the keys are the new tokens themselves when every row starts at 0 (nothing
  read from the pool), else the rows' blocks up to start + S. A single fresh row without window or sinks runs as
  plain causal SDPA (no mask, so the fused kernels are eligible).
Padding is masked out (boolean masks: True = attend); a padded query row attends its first key only, so no row is
all-masked (no NaN), and padded outputs are dropped.

`StepLayout` is what every layer of a step shares (who is in which group, slots to write, block tables, masks by
window); `attend` is one layer's attention given its queries and new cache entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_cache import KVCache, PagedKVPool

# A layer's map from cache entries ({name: [B, L, *shape]}) to keys [B, L, kvh, Dqk] and values [B, L, kvh, Dv].
KeysValues = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StepLayout:
    """One step's (or micro-batch's) sequences as the attention of every layer sees them."""

    lengths: list[int]
    starts: list[int]
    pool: PagedKVPool | None  # None: no cache (every row a fresh prefill, nothing written)
    slots: torch.Tensor | None  # [T] where the new tokens go in the pool
    decode_rows: list[int]
    decode_index: torch.Tensor  # [Bd] each decode row's token in [T]
    decode_table: torch.Tensor | None  # [Bd, nb]
    decode_kv_len: torch.Tensor | None  # [Bd]
    prefill_rows: list[int]
    prefill_index: torch.Tensor  # [Bp, S] token of [T] at each padded query slot (clamped into the row)
    prefill_valid: torch.Tensor  # [Bp, S] True where a real query is
    prefill_table: torch.Tensor | None  # [Bp, nb] when a row has history; None: keys are the new tokens
    prefill_kv_len: torch.Tensor  # [Bp] keys each row attends (start + S_i)
    _masks: dict = field(default_factory=dict)  # (group, window) -> mask, built once per step

    @classmethod
    def build(cls, lengths: list[int], starts: list[int], caches: list[KVCache] | None,
              device: torch.device) -> StepLayout:
        """caches (reserved for the new tokens; None: a cacheless forward) in step order."""
        pool = caches[0].pool if caches else None
        slots = pool.slots(caches, lengths) if pool is not None else None
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        decode = [i for i, (n, s) in enumerate(zip(lengths, starts)) if n == 1 and s > 0 and pool is not None]
        prefill = [i for i in range(len(lengths)) if i not in set(decode)]
        decode_table = decode_kv_len = None
        if decode:
            decode_table, decode_kv_len = pool.block_table([caches[i] for i in decode], [starts[i] + 1 for i in decode])
        s_max = max((lengths[i] for i in prefill), default=0)
        col = torch.arange(s_max)  # [S]
        n_p = torch.tensor([lengths[i] for i in prefill], dtype=torch.int64)  # [Bp]
        first = torch.tensor([offsets[i] for i in prefill], dtype=torch.int64)  # [Bp]
        valid = col[None, :] < n_p[:, None]  # [Bp, S]
        index = first[:, None] + torch.minimum(col[None, :], (n_p - 1).clamp(min=0)[:, None])  # [Bp, S]
        history = any(starts[i] > 0 for i in prefill)
        prefill_table = None
        if history:
            prefill_table, _ = pool.block_table([caches[i] for i in prefill], [starts[i] + lengths[i] for i in prefill])
        return cls(
            lengths=lengths, starts=starts, pool=pool, slots=slots,
            decode_rows=decode, decode_index=torch.tensor([offsets[i] for i in decode], dtype=torch.int64,
                                                          device=device),
            decode_table=decode_table, decode_kv_len=decode_kv_len,
            prefill_rows=prefill, prefill_index=index.to(device), prefill_valid=valid.to(device),
            prefill_table=prefill_table,
            prefill_kv_len=torch.tensor([starts[i] + lengths[i] for i in prefill], dtype=torch.int64, device=device),
        )

    # ---- masks (True = attend), cached per window value ----------------------------------------------------

    def decode_mask(self, window: int | None) -> torch.Tensor:
        key = ("decode", window)
        if key not in self._masks:
            kv_len = self.decode_kv_len  # [Bd]; the query sits at position kv_len - 1
            k_pos = torch.arange(self.decode_table.shape[1] * self.pool.block_size, device=kv_len.device)  # [L]
            mask = k_pos[None, :] < kv_len[:, None]  # [Bd, L]
            if window is not None:
                mask &= (kv_len[:, None] - 1 - k_pos[None, :]) < window
            self._masks[key] = mask[:, None, None, :]  # [Bd, 1, 1, L]
        return self._masks[key]

    def prefill_mask(self, window: int | None, num_keys: int) -> torch.Tensor:
        key = ("prefill", window, num_keys)
        if key not in self._masks:
            device = self.prefill_valid.device
            starts = torch.tensor([self.starts[i] for i in self.prefill_rows], dtype=torch.int64, device=device)
            s = self.prefill_valid.shape[1]
            q_pos = starts[:, None] + torch.arange(s, device=device)[None, :]  # [Bp, S]
            # Keys: absolute positions when read from the pool; the new tokens (positions start..) otherwise.
            k_pos = torch.arange(num_keys, device=device)[None, :]  # [1, L]
            if self.prefill_table is None:
                k_pos = k_pos + starts[:, None]  # [Bp, L] (starts are 0 here)
            mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] < self.prefill_kv_len[:, None, None])
            if window is not None:
                mask &= (q_pos[:, :, None] - k_pos[:, None, :]) < window
            mask &= self.prefill_valid[:, :, None]
            mask[:, :, 0] |= ~self.prefill_valid  # a padded query attends key 0 only: never an all-masked row
            self._masks[key] = mask[:, None]  # [Bp, 1, S, L]
        return self._masks[key]

    def plain_causal(self, window: int | None, sinks: torch.Tensor | None) -> bool:
        """One fresh prefill row, no window, no sinks: SDPA's is_causal, no mask."""
        return (len(self.prefill_rows) == 1 and self.prefill_table is None and window is None and sinks is None)


def attend(layout: StepLayout, layer: int, q: torch.Tensor, entries: dict[str, torch.Tensor],
           keys_values: KeysValues, scale: float | None, window: int | None,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """One layer's attention for the step. q: [T, nh, Dqk]; entries: the new tokens' cache entries
    ({name: [T, *shape]}), written to the pool first. Returns o [T, nh * Dv] in token order."""
    if layout.pool is not None:
        layout.pool.write(layer, layout.slots, entries)
    t, nh = q.shape[0], q.shape[1]
    out: torch.Tensor | None = None
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (token index [n], o [n, nh, Dv])
    if layout.decode_rows:
        k, v = keys_values(layout.pool.gather(layer, layout.decode_table))  # [Bd, L, kvh, D]
        qd = q[layout.decode_index][:, :, None, :]  # [Bd, nh, 1, D]
        o = _sdpa(qd, k.transpose(1, 2), v.transpose(1, 2), layout.decode_mask(window), scale, sinks)
        parts.append((layout.decode_index, o[:, :, 0, :]))  # [Bd, nh, Dv]
    if layout.prefill_rows:
        qp = q[layout.prefill_index].transpose(1, 2)  # [Bp, nh, S, D]
        if layout.prefill_table is None:
            new = {name: e[layout.prefill_index] for name, e in entries.items()}  # [Bp, S, *shape]
            k, v = keys_values(new)
        else:
            k, v = keys_values(layout.pool.gather(layer, layout.prefill_table))  # [Bp, L, kvh, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [Bp, kvh, L, D]
        if layout.plain_causal(window, sinks):
            o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale,
                                               enable_gqa=k.shape[1] != nh)
        else:
            o = _sdpa(qp, k, v, layout.prefill_mask(window, k.shape[2]), scale, sinks)  # [Bp, nh, S, Dv]
        o = o.transpose(1, 2)[layout.prefill_valid]  # [T_p, nh, Dv] real queries, row-major = token order
        parts.append((layout.prefill_index[layout.prefill_valid], o))
    if len(parts) == 1 and torch.equal(parts[0][0], torch.arange(t, device=q.device)):
        out = parts[0][1]
    else:
        out = q.new_empty((t, nh, parts[0][1].shape[-1]))
        for index, o in parts:
            out[index] = o
    return out.reshape(t, -1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
          sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, nh, S, D], k [B, kvh, L, D], v [B, kvh, L, Dv], mask [B, 1, S, L] -> [B, nh, S, Dv]. With sinks
    ([nh], gpt-oss): a per-head extra logit in the softmax's denominator, which SDPA has no argument for."""
    nh, kvh = q.shape[1], k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=kvh != nh)
    if kvh != nh:
        k, v = k.repeat_interleave(nh // kvh, dim=1), v.repeat_interleave(nh // kvh, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)).float() * scale  # [B, nh, S, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)  # [B, nh, S, 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # [B, nh, S, L]
    return (probs.to(v.dtype) @ v)  # [B, nh, S, Dv]
