"""Planning and combining a layer's expert calls: pure functions on tensors (no Ray, gRPC or OpenTelemetry), so
the dispatcher's arithmetic is unit-tested, and run on a machine without Ray, on its own.

  plan_calls  routing [T, k] + routing table -> one ActorCall per actor that has tokens (rows grouped by expert)
  combine     the calls' outputs -> sum over slots of gate weight * expert output, [T, H], in the reference's order
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..cluster.routing_table import RoutingTable, Shard, split_tokens
from ..experts.gating import Routing


@dataclass
class ActorCall:
    """Everything one actor gets for one layer: rows of several experts, grouped by expert."""

    actor: str
    experts: list[int] = field(default_factory=list)
    token_idx: list[torch.Tensor] = field(default_factory=list)  # per expert: [n_e] token positions
    slot_idx: list[torch.Tensor] = field(default_factory=list)  # per expert: [n_e] which of the k slots

    @property
    def counts(self) -> list[int]:
        return [int(t.numel()) for t in self.token_idx]


def plan_calls(
    layer: int, routing: Routing, table: RoutingTable,
    replicas_of: Callable[[Shard], Sequence[str]] | None = None,
) -> list[ActorCall]:
    """One ActorCall per actor that has tokens this layer, in a deterministic order (by expert, then actor).
    replicas_of picks which replicas of a shard may take calls (default: all in the table)."""
    calls: dict[str, ActorCall] = {}
    for expert in torch.unique(routing.experts[routing.experts >= 0]).tolist():
        token_idx, slot_idx = torch.nonzero(routing.experts == expert, as_tuple=True)  # [n], [n]
        shard = (layer, expert)
        if replicas_of is None:
            chunks = table.split(shard, int(token_idx.numel()))
        else:
            chunks = split_tokens(replicas_of(shard), int(token_idx.numel()))
        for actor, start, end in chunks:
            add_rows(calls, actor, expert, token_idx[start:end], slot_idx[start:end])
    return list(calls.values())


def add_rows(calls: dict[str, ActorCall], actor: str, expert: int, token_idx: torch.Tensor,
             slot_idx: torch.Tensor) -> None:
    """Add one expert's rows to `actor`'s call (created on first use)."""
    call = calls.setdefault(actor, ActorCall(actor))
    call.experts.append(expert)
    call.token_idx.append(token_idx)
    call.slot_idx.append(slot_idx)


def combine(
    hidden: torch.Tensor, routing: Routing, calls: list[ActorCall], outputs: list[torch.Tensor]
) -> torch.Tensor:
    """sum over slots of weight * expert output. hidden: [T, H] (for shape/dtype); outputs[i]: [sum counts, H].

    Outputs are added expert by expert in ascending expert id, the order of the in-process reference, so the
    floating-point sums match it whichever replicas served the step.
    """
    pieces: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for call, out in zip(calls, outputs):
        for expert, token_idx, slot_idx, y in zip(call.experts, call.token_idx, call.slot_idx, out.split(call.counts)):
            pieces.append((expert, token_idx, slot_idx, y))
    pieces.sort(key=lambda p: (p[0], int(p[1][0]) if p[1].numel() else -1))
    result = torch.zeros_like(hidden)  # [T, H]
    for _, token_idx, slot_idx, y in pieces:
        weighted = y * routing.weights[token_idx, slot_idx, None]  # [n, H]
        result.index_add_(0, token_idx, weighted.to(hidden.dtype))
    return result
