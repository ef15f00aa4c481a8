"""Planning and combining a layer's expert calls: pure functions on tensors (no Ray, gRPC or OpenTelemetry), so
the dispatcher's arithmetic is unit-tested, and run on a machine without Ray, on its own.

  plan_calls  routing [T, k] + routing table -> one ActorCall per actor that has tokens (rows grouped by expert)
  combine     the calls' outputs -> sum over slots of gate weight * expert output, [T, H], in the reference's order

Both are vectorised for models with hundreds of experts: one stable sort of the layer's (token, slot) pairs by
expert; each actor's rows are then one slice of them (or, when replicas split shards, one stable sort of the rows
by actor); one combine shared with the reference (experts/routed_rows.py `combine_pieces`).
What stays in Python is one step per expert hit (its replicas from the table: a dict look-up and, with several
replicas, the split into contiguous chunks) - the routing table and the breakers are Python objects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from ..cluster.routing_table import RoutingTable, Shard, split_tokens
from ..experts.gating import Routing
from ..experts.routed_rows import PIECE_LOOP_MAX, Piece, SortedRows, combine_pieces, combine_rows, sort_rows

_NO_ROWS = torch.zeros(0, dtype=torch.int64)  # host: plan indices


@dataclass
class ActorCall:
    """Everything one actor gets for one layer: rows of several experts, grouped by expert (ascending)."""

    actor: str
    experts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # rows of each expert, aligned with `experts`
    tokens: torch.Tensor = field(default_factory=lambda: _NO_ROWS)  # [sum counts] token positions, by expert
    slots: torch.Tensor = field(default_factory=lambda: _NO_ROWS)  # [sum counts] which of the k slots

    @classmethod
    def of(cls, actor: str, experts: list[int], token_idx: Sequence[torch.Tensor],
           slot_idx: Sequence[torch.Tensor]) -> ActorCall:
        """A call from per-expert pieces: token_idx[i], slot_idx[i] are expert experts[i]'s rows."""
        call = cls(actor)
        for expert, tokens, slots in zip(experts, token_idx, slot_idx):
            add_rows({actor: call}, actor, expert, tokens, slots)
        return call

    @property
    def token_idx(self) -> tuple[torch.Tensor, ...]:
        """Per expert: [n_e] token positions (views of `tokens`)."""
        return self.tokens.split(self.counts)

    @property
    def slot_idx(self) -> tuple[torch.Tensor, ...]:
        """Per expert: [n_e] slots (views of `slots`)."""
        return self.slots.split(self.counts)


def plan_calls(
    layer: int, routing: Routing, table: RoutingTable,
    replicas_of: Callable[[Shard], Sequence[str]] | None = None,
) -> list[ActorCall]:
    """One ActorCall per actor that has tokens this layer, in a deterministic order (actors as their first rows
    appear by expert id, then replica order). A shard's rows are split over its replicas in contiguous chunks
    (RoutingTable.split). replicas_of picks which replicas of a shard may take calls (default: all in the table)."""
    rows = sort_rows(routing.experts)
    if replicas_of is None:
        fast = _single_replica_calls(layer, rows, table)
        if fast is not None:
            return fast
    calls: dict[str, ActorCall] = {}
    ranges: dict[str, list[list[int]]] = {}  # per call: [start, end) ranges of the expert-sorted rows
    call_index: dict[str, int] = {}
    piece_actor: list[int] = []  # per (expert, replica) piece, in row order: index of its actor's call
    piece_rows: list[int] = []
    offset = 0
    for expert, count in zip(rows.experts, rows.counts):
        shard = (layer, expert)
        actors = table.replicas.get(shard) if replicas_of is None else replicas_of(shard)
        if replicas_of is None and not actors:
            table.split(shard, count)  # raises KeyError naming the shard
        if len(actors) == 1:  # the common case, without split_tokens' arithmetic
            chunks = [(actors[0], 0, count)]
        else:
            chunks = split_tokens(actors, count)
        for actor, start, end in chunks:
            call = calls.get(actor)
            if call is None:
                call = calls[actor] = ActorCall(actor)
                call_index[actor] = len(call_index)
                ranges[actor] = []
            call.experts.append(expert)
            call.counts.append(end - start)
            spans = ranges[actor]
            if spans and spans[-1][1] == offset + start:
                spans[-1][1] = offset + end  # adjacent in the sorted rows: one slice (an actor's expert slice)
            else:
                spans.append([offset + start, offset + end])
            piece_actor.append(call_index[actor])
            piece_rows.append(end - start)
        offset += count
    ordered = list(calls.values())
    if all(len(spans) == 1 for spans in ranges.values()):
        # Every actor's rows are one run of the sorted rows (one expert, or a contiguous slice of experts, each on
        # one replica): views, no copy.
        for call in ordered:
            (start, end), = ranges[call.actor]
            call.tokens, call.slots = rows.tokens[start:end], rows.slots[start:end]
        return ordered
    row_actor = torch.repeat_interleave(torch.tensor(piece_actor), torch.tensor(piece_rows))  # host: plan indices; [N]
    # Stable: within an actor its rows stay grouped by expert ascending, and chunks of one expert in token order.
    by_actor = torch.sort(row_actor, stable=True).indices  # [N]
    sizes = [sum(c.counts) for c in ordered]
    for call, tokens, slots in zip(ordered, rows.tokens[by_actor].split(sizes), rows.slots[by_actor].split(sizes)):
        call.tokens, call.slots = tokens, slots
    return ordered


def _single_replica_calls(layer: int, rows: SortedRows, table: RoutingTable) -> list[ActorCall] | None:
    """plan_calls without a Python step per expert, when every shard of the layer has one replica and each actor's
    experts are a contiguous run of the hit experts (one expert per actor, or a slice per device): the calls are
    runs of the expert-sorted rows, found with one look-up tensor. None: use the general path (same result)."""
    lookup = _actor_lookup(table, layer)
    if lookup is None:
        return None
    names, index = lookup
    if not rows.experts:
        return []
    hit = torch.tensor(rows.experts)  # host: plan indices; [n_hit]
    if int(hit[-1]) >= index.numel():
        return None
    ids = index[hit]  # [n_hit] actor of each hit expert
    if bool((ids < 0).any()):
        return None  # a shard without a replica: the general path raises naming it
    run_ids, run_lengths = torch.unique_consecutive(ids, return_counts=True)
    run_ids, run_lengths = run_ids.tolist(), run_lengths.tolist()
    if len(set(run_ids)) != len(run_ids):
        return None  # an actor's experts are not one run
    row_ends = list(accumulate(rows.counts, initial=0))
    calls, first = [], 0
    for actor_id, length in zip(run_ids, run_lengths):
        last = first + length
        lo, hi = row_ends[first], row_ends[last]
        calls.append(ActorCall(names[actor_id], rows.experts[first:last], rows.counts[first:last],
                               rows.tokens[lo:hi], rows.slots[lo:hi]))
        first = last
    return calls


def all_served(table: RoutingTable, layer: int, experts: torch.Tensor) -> bool:
    """Whether the table has a replica for every expert routed in `experts` ([T, k], -1 = dropped) at `layer`,
    checked with one cached [E] mask."""
    cache = table.__dict__.setdefault("_served_mask", {})
    mask = cache.get(layer)
    if mask is None:
        served = [expert for (shard_layer, expert), actors in table.replicas.items() if shard_layer == layer and actors]
        mask = cache[layer] = torch.zeros(max(served, default=-1) + 1, dtype=torch.bool)  # host: plan indices
        mask[served] = True
    ids = experts[experts >= 0]
    return ids.numel() == 0 or (int(ids.max()) < mask.numel() and bool(mask[ids].all()))


def _actor_lookup(table: RoutingTable, layer: int) -> tuple[list[str], torch.Tensor] | None:
    """(actor names, [E] int64 index of each expert's only replica, -1 for none) of one layer, or None when a shard
    of the layer has several replicas. Cached on the table (a table never changes; a new epoch is a new table)."""
    cache = table.__dict__.setdefault("_single_replica_lookup", {})
    if layer not in cache:
        names: list[str] = []
        position: dict[str, int] = {}
        experts: dict[int, int] = {}
        single = True
        for (shard_layer, expert), actors in table.replicas.items():
            if shard_layer != layer:
                continue
            if len(actors) != 1:
                single = False
                break
            experts[expert] = position.setdefault(actors[0], len(position))
        if single:
            names = list(position)
            index = torch.full((max(experts, default=-1) + 1,), -1, dtype=torch.int64)  # host: plan indices
            for expert, actor in experts.items():
                index[expert] = actor
            cache[layer] = (names, index)
        else:
            cache[layer] = None
    return cache[layer]


def add_rows(calls: dict[str, ActorCall], actor: str, expert: int, token_idx: torch.Tensor,
             slot_idx: torch.Tensor) -> None:
    """Add one expert's rows to `actor`'s call (created on first use). For re-planning a failed call's rows, a
    handful of pieces: each addition concatenates."""
    call = calls.setdefault(actor, ActorCall(actor))
    call.experts.append(expert)
    call.counts.append(int(token_idx.numel()))
    call.tokens = torch.cat([call.tokens, token_idx])
    call.slots = torch.cat([call.slots, slot_idx])


def combine(
    hidden: torch.Tensor, routing: Routing, calls: list[ActorCall], outputs: list[torch.Tensor]
) -> torch.Tensor:
    """sum over slots of weight * expert output. hidden: [T, H] (for shape/dtype); outputs[i]: [sum counts, H].

    Each token's outputs are added in one fixed order (its experts by ascending id: experts/routed_rows.py), the
    order of the in-process reference, so the floating-point sums match it whichever replicas served the step.
    """
    if sum(len(call.experts) for call in calls) > PIECE_LOOP_MAX:
        # Many pieces: the rank passes over all rows at once (the same bits as piece by piece, any row order), with
        # no per-expert Python objects (at 256 experts these cost more than the arithmetic).
        if not calls:
            return torch.zeros_like(hidden)
        return combine_rows(hidden, routing, torch.cat([c.tokens for c in calls]),
                            torch.cat([c.slots for c in calls]), torch.cat(list(outputs)))
    pieces = [
        Piece(expert, tokens, slots, y)
        for call, out in zip(calls, outputs)
        for expert, tokens, slots, y in zip(call.experts, call.token_idx, call.slot_idx, out.split(call.counts))
    ]
    return combine_pieces(hidden, routing, pieces)
