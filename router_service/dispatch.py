"""Per-layer dispatch: group the routed tokens by expert actor, make one call per actor that has tokens, all
calls in flight together, then combine the outputs with the gate weights.

`plan_calls` is pure (no Ray) so grouping is unit-tested; `RemoteExperts` is the ExpertBackend the router's decoder
uses, wiring the plan to a Transport.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..cluster.routing_table import RoutingTable
from ..experts.gating import Routing
from .transport import Transport


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


def plan_calls(layer: int, routing: Routing, table: RoutingTable) -> list[ActorCall]:
    """One ActorCall per actor that has tokens this layer, in a deterministic order (by expert, then actor)."""
    calls: dict[str, ActorCall] = {}
    for expert in torch.unique(routing.experts[routing.experts >= 0]).tolist():
        token_idx, slot_idx = torch.nonzero(routing.experts == expert, as_tuple=True)  # [n], [n]
        for actor, start, end in table.split((layer, expert), int(token_idx.numel())):
            call = calls.setdefault(actor, ActorCall(actor))
            call.experts.append(expert)
            call.token_idx.append(token_idx[start:end])
            call.slot_idx.append(slot_idx[start:end])
    return list(calls.values())


def combine(
    hidden: torch.Tensor, routing: Routing, calls: list[ActorCall], outputs: list[torch.Tensor]
) -> torch.Tensor:
    """sum over slots of weight * expert output. hidden: [T, H] (for shape/dtype); outputs[i]: [sum counts, H].

    Outputs are added expert by expert in ascending expert id, the order of the in-process reference, so the
    floating-point sums match it.
    """
    pieces: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for call, out in zip(calls, outputs):
        for expert, token_idx, slot_idx, y in zip(call.experts, call.token_idx, call.slot_idx, out.split(call.counts)):
            pieces.append((expert, token_idx, slot_idx, y))
    pieces.sort(key=lambda p: p[0])
    result = torch.zeros_like(hidden)  # [T, H]
    for _, token_idx, slot_idx, y in pieces:
        weighted = y * routing.weights[token_idx, slot_idx, None]  # [n, H]
        result.index_add_(0, token_idx, weighted.to(hidden.dtype))
    return result


class RemoteExperts:
    """ExpertBackend whose experts live in actors behind a Transport."""

    def __init__(self, table: RoutingTable, transport: Transport):
        self.table = table
        self.transport = transport
        self.calls_per_layer: dict[int, int] = {}  # of the most recent forward; tests check calls == actors hit
        self.round_seconds = 0.0  # wall time spent in expert rounds since creation (benchmarks read it)

    def run(self, layer: int, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        started = time.perf_counter()
        calls = plan_calls(layer, routing, self.table)
        handles = []
        for call in calls:
            rows = torch.cat(call.token_idx)
            x = hidden[rows].contiguous().numpy()  # [n, H]
            handles.append(self.transport.submit(call.actor, layer, call.experts, call.counts, x))
        outputs = self.transport.gather(handles) if handles else []
        self.calls_per_layer[layer] = len(calls)
        result = combine(hidden, routing, calls, outputs)
        self.round_seconds += time.perf_counter() - started
        return result
