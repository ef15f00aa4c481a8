"""The attention math over cached history: scaled dot-product attention with causal masking, an optional sliding
window or attention chunk (Llama 4: a query sees only the keys of its own `chunk`-token block) and optional attention
sinks, for a prefilling sequence or a batch of decoding ones.

Attention *layers* (experts/attention.py, per family) decide what q, k and v are; this module only attends.
Without sinks it calls `F.scaled_dot_product_attention` (fused kernels where eligible). With sinks (gpt-oss: a
learned per-head logit that joins every row's softmax and attends to nothing) it computes the softmax itself, the
way `transformers` does, since SDPA has no such term.

Over the paged KV cache (experts/kv_cache.py) a step attends as two groups, each in one 4-D call (`StepLayout`,
`attend`):
- decode rows (one new token after some history): their histories are gathered from the pool through one padded
  block table ([B, nb] -> [B, L, ...]) and masked by length (and window);
- prefill rows (several new tokens: a prompt, or a chunk of one after `start` earlier tokens): their queries are
  padded to the longest ([B, S, ...]); the keys are the new tokens themselves when every row starts at 0 (nothing
  read from the pool), else the rows' blocks up to start + S. A single fresh row without window or sinks runs as
  plain causal SDPA (no mask, so the fused kernels are eligible).
Padding is masked out (boolean masks: True = attend); a padded query row attends its first key only, so no row is
all-masked, and padded outputs are dropped. `attend_prefill` / `attend_decode` are the same math for one sequence
/ for dense padded histories (the obvious forms the tests compare against).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .device_rule import tensor_on, to_device
from .kv_cache import KVCache, PagedKVPool

# A layer's map from cache entries ({name: [B, L, *shape]}) to keys [B, L, kvh, Dqk] and values [B, L, kvh, Dv].
KeysValues = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
# A sparse-attention selection (DSA): (layout, group "decode" | "prefill", the rows' query tokens [B, S] in [T],
# the keys' cache entries {name: [B, L, *shape]}, the allowed mask [B, 1, S, L]) -> (the mask to attend with
# [B, 1, S, L], within the allowed one; the picked key positions [B, S, k] or None). Decode rows whose picks are
# fewer than their history attend the picked keys only (gathered before keys_values expands them).
Select = Callable[["StepLayout", str, torch.Tensor, dict[str, torch.Tensor], torch.Tensor],
                  tuple[torch.Tensor, torch.Tensor | None]]


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
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention of one sequence's S new tokens at positions start..start+S-1 -> [S, nh*Dv]."""
    num_new = q.shape[0]
    mask = prefill_mask(num_new, start, window, q.device, chunk)
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
    chunk: int | None = None,
) -> torch.Tensor:
    """One attention call for B sequences that each add a single token -> [B, nh*Dv]. Padding is masked out."""
    positions = torch.arange(k.shape[1], device=q.device)[None, :]  # [1, L]
    mask = positions < lengths[:, None]  # [B, L]: a real position
    if window is not None:
        mask &= (lengths[:, None] - 1 - positions) < window  # within the window of the query at length-1
    if chunk is not None:
        mask &= positions // chunk == (lengths[:, None] - 1) // chunk  # in the chunk of the query at length-1
    out = _sdpa(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),  # [B, nh, 1, Dqk], [B, kvh, L, Dqk], [B, kvh, L, Dv]
        mask[:, None, None, :], False, scale, sinks,
    )  # [B, nh, 1, Dv]
    return out.reshape(q.shape[0], -1)


def prefill_mask(num_new: int, start: int, window: int | None, device: torch.device | str = "cpu",
                 chunk: int | None = None) -> torch.Tensor | None:
    """Boolean [S, start+S] mask (True = attend), or None when plain causal (or no) masking is exact."""
    if window is None and chunk is None and (start == 0 or num_new == 1):
        return None  # is_causal covers a fresh prefill; a single new token attends to everything before it
    q_pos = torch.arange(start, start + num_new, device=device)[:, None]
    k_pos = torch.arange(start + num_new, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    if chunk is not None:
        mask &= k_pos // chunk == q_pos // chunk
    return mask


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
    prefill_flat: torch.Tensor  # [T_p] where the real queries are in the [Bp * S] padded rows, row-major
    prefill_tokens: torch.Tensor  # [T_p] their tokens in [T]
    prefill_table: torch.Tensor | None  # [Bp, nb] when a row has history; None: keys are the new tokens
    prefill_kv_len: torch.Tensor  # [Bp] keys each row attends (start + S_i)
    _masks: dict = field(default_factory=dict)  # (group, window, chunk, ..) -> mask, built once per step
    # DSA (experts/dsa_indexer.py): the last indexer's selection per row group ("decode" / "prefill"), which GLM-5's
    # shared layers reuse
    selections: dict = field(default_factory=dict)

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
        prefill = sorted(set(range(len(lengths))) - set(decode))
        decode_table = decode_kv_len = None
        if decode:
            decode_table, decode_kv_len = pool.block_table([caches[i] for i in decode], [starts[i] + 1 for i in decode])
        s_max = max((lengths[i] for i in prefill), default=0)
        col = torch.arange(s_max)  # host: built here, sent up once; [S]
        n_p = torch.tensor([lengths[i] for i in prefill], dtype=torch.int64)  # host: built here, sent up once; [Bp]
        first = torch.tensor([offsets[i] for i in prefill], dtype=torch.int64)  # host: built here, sent up once; [Bp]
        valid = col[None, :] < n_p[:, None]  # [Bp, S]
        index = first[:, None] + torch.minimum(col[None, :], (n_p - 1).clamp(min=0)[:, None])  # [Bp, S]
        flat = valid.reshape(-1).nonzero().flatten()  # [T_p] (host tensors: no device read)
        history = any(starts[i] > 0 for i in prefill)
        prefill_table = None
        if history:
            prefill_table, _ = pool.block_table([caches[i] for i in prefill], [starts[i] + lengths[i] for i in prefill])
        return cls(
            lengths=lengths, starts=starts, pool=pool, slots=slots,
            decode_rows=decode, decode_index=tensor_on([offsets[i] for i in decode], torch.int64, device),
            decode_table=decode_table, decode_kv_len=decode_kv_len,
            prefill_rows=prefill, prefill_index=to_device(index, device), prefill_valid=to_device(valid, device),
            # Picked with host-made indices, not the boolean mask: a device mask as an index reads its count back.
            prefill_flat=to_device(flat, device), prefill_tokens=to_device(index.reshape(-1)[flat], device),
            prefill_table=prefill_table,
            prefill_kv_len=tensor_on([starts[i] + lengths[i] for i in prefill], torch.int64, device),
        )

    # ---- masks (True = attend), cached per window and chunk value ------------------------------------------

    def decode_mask(self, window: int | None, chunk: int | None = None) -> torch.Tensor:
        key = ("decode", window, chunk)
        if key not in self._masks:
            kv_len = self.decode_kv_len  # [Bd]; the query sits at position kv_len - 1
            k_pos = torch.arange(self.decode_table.shape[1] * self.pool.block_size, device=kv_len.device)  # [L]
            mask = k_pos[None, :] < kv_len[:, None]  # [Bd, L]
            if window is not None:
                mask &= (kv_len[:, None] - 1 - k_pos[None, :]) < window
            if chunk is not None:  # the query's own chunk only
                mask &= k_pos[None, :] // chunk == (kv_len[:, None] - 1) // chunk
            self._masks[key] = mask[:, None, None, :]  # [Bd, 1, 1, L]
        return self._masks[key]

    def prefill_mask(self, window: int | None, num_keys: int, chunk: int | None = None) -> torch.Tensor:
        key = ("prefill", window, num_keys, chunk)
        if key not in self._masks:
            device = self.prefill_valid.device
            starts = tensor_on([self.starts[i] for i in self.prefill_rows], torch.int64, device)
            s = self.prefill_valid.shape[1]
            q_pos = starts[:, None] + torch.arange(s, device=device)[None, :]  # [Bp, S]
            # Keys: absolute positions when read from the pool; the new tokens (positions start..) otherwise.
            k_pos = torch.arange(num_keys, device=device)[None, :]  # [1, L]
            if self.prefill_table is None:
                k_pos = k_pos + starts[:, None]  # [Bp, L] (starts are 0 here)
            mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] < self.prefill_kv_len[:, None, None])
            if window is not None:
                mask &= (q_pos[:, :, None] - k_pos[:, None, :]) < window
            if chunk is not None:
                mask &= k_pos[:, None, :] // chunk == q_pos[:, :, None] // chunk
            mask &= self.prefill_valid[:, :, None]
            mask[:, :, 0] |= ~self.prefill_valid  # a padded query attends key 0 only: never an all-masked row
            self._masks[key] = mask[:, None]  # [Bp, 1, S, L]
        return self._masks[key]

    def plain_causal(self, window: int | None, sinks: torch.Tensor | None, chunk: int | None = None) -> bool:
        """One fresh prefill row, no window, no chunk, no sinks: SDPA's is_causal, no mask."""
        return (len(self.prefill_rows) == 1 and self.prefill_table is None and window is None and sinks is None
                and chunk is None)


def attend(layout: StepLayout, layer: int, q: torch.Tensor, entries: dict[str, torch.Tensor],
           keys_values: KeysValues, scale: float, window: int | None,
           sinks: torch.Tensor | None, chunk: int | None = None, select: Select | None = None) -> torch.Tensor:
    """One layer's attention for the step. q: [T, nh, Dqk]; entries: the new tokens' cache entries
    ({name: [T, *shape]}), written to the pool first. chunk: attend within `chunk`-token blocks of positions.
    select: narrows each query's keys further (DSA's top-k). Returns o [T, nh * Dv] in token order."""
    if layout.pool is not None:
        layout.pool.write(layer, layout.slots, entries)
    t, nh = q.shape[0], q.shape[1]
    out: torch.Tensor | None = None
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (token index [n], o [n, nh, Dv])
    if layout.decode_rows:
        cached = layout.pool.gather(layer, layout.decode_table, "decode")
        qd = q[layout.decode_index][:, :, None, :]  # [Bd, nh, 1, D]
        mask = layout.decode_mask(window, chunk)  # [Bd, 1, 1, L]
        if select is not None:
            mask, picks = select(layout, "decode", layout.decode_index[:, None], cached, mask)
            if picks is not None and picks.shape[-1] < mask.shape[-1]:
                cached, mask = _take_picked(cached, mask, picks[:, 0])  # L -> k keys per row
        k, v = keys_values(cached)  # [Bd, L (or k picked), kvh, D]
        o = _sdpa(qd, k.transpose(1, 2), v.transpose(1, 2), mask, False, scale, sinks)
        parts.append((layout.decode_index, o[:, :, 0, :]))  # [Bd, nh, Dv]
    if layout.prefill_rows:
        qp = q[layout.prefill_index].transpose(1, 2)  # [Bp, nh, S, D]
        if layout.prefill_table is None:
            cached = {name: e[layout.prefill_index] for name, e in entries.items()}  # [Bp, S, *shape]
        else:
            cached = layout.pool.gather(layer, layout.prefill_table, "prefill")  # [Bp, L, *shape]
        k, v = keys_values(cached)  # [Bp, L, kvh, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [Bp, kvh, L, D]
        if select is None and layout.plain_causal(window, sinks, chunk):
            o = _sdpa(qp, k, v, None, True, scale, None)  # [1, nh, S, Dv]
        else:
            mask = layout.prefill_mask(window, k.shape[2], chunk)  # [Bp, 1, S, L]
            if select is not None:  # prefill rows' picks differ per query: the keys stay whole, masked
                mask, _ = select(layout, "prefill", layout.prefill_index, cached, mask)
            o = _sdpa(qp, k, v, mask, False, scale, sinks)  # [Bp, nh, S, Dv]
        o = o.transpose(1, 2).flatten(0, 1).index_select(0, layout.prefill_flat)  # [T_p, nh, Dv] real queries
        parts.append((layout.prefill_tokens, o))
    if len(parts) == 1:
        # One kind of row only: its rows are every token, in order (decode rows ascending, or prefill rows ascending
        # with their queries row-major), so the part is the output as it stands.
        out = parts[0][1]
    else:
        out = q.new_empty((t, nh, parts[0][1].shape[-1]))
        for index, o in parts:
            out[index] = o
    return out.reshape(t, -1)


def _take_picked(cached: dict[str, torch.Tensor], mask: torch.Tensor, picks: torch.Tensor
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Decode rows' cache entries {name: [B, L, *shape]} and mask [B, 1, 1, L] -> the same at the picked positions
    picks [B, k] only: {name: [B, k, *shape]}, [B, 1, 1, k]. A pick outside the allowed keys stays masked."""
    out = {}
    for name, e in cached.items():
        index = picks.view(*picks.shape, *([1] * (e.dim() - 2))).expand(*picks.shape, *e.shape[2:])
        out[name] = torch.gather(e, 1, index)  # [B, k, *shape]
    return out, torch.gather(mask[:, 0, 0], 1, picks)[:, None, None, :]


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
