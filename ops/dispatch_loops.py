"""Main's per-expert loops for planning, combining and the reference's expert compute, as they were before the
vectorised versions (router_service/dispatch_plan.py, experts/routed_rows.py, experts/grouped_ffn.py) replaced them.

Kept for two readers: `expertmesh bench dispatch-overhead` times them as "before", and the unit tests use them as the
slow obvious oracle that the vectorised code must equal bit for bit. Not used by serving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..cluster.routing_table import RoutingTable, Shard, split_tokens
from ..experts.ffn import GatedMLPWeights, gated_mlp
from ..experts.gating import Routing


@dataclass
class LoopCall:
    """Main's ActorCall: per-expert lists of row indices."""

    actor: str
    experts: list[int] = field(default_factory=list)
    token_idx: list[torch.Tensor] = field(default_factory=list)  # per expert: [n_e] token positions
    slot_idx: list[torch.Tensor] = field(default_factory=list)  # per expert: [n_e] which of the k slots

    @property
    def counts(self) -> list[int]:
        return [int(t.numel()) for t in self.token_idx]


def loop_plan_calls(layer: int, routing: Routing, table: RoutingTable,
                    replicas_of: Callable[[Shard], Sequence[str]] | None = None) -> list[LoopCall]:
    calls: dict[str, LoopCall] = {}
    for expert in torch.unique(routing.experts[routing.experts >= 0]).tolist():
        token_idx, slot_idx = torch.nonzero(routing.experts == expert, as_tuple=True)  # [n], [n]
        shard = (layer, expert)
        if replicas_of is None:
            chunks = table.split(shard, int(token_idx.numel()))
        else:
            chunks = split_tokens(replicas_of(shard), int(token_idx.numel()))
        for actor, start, end in chunks:
            call = calls.setdefault(actor, LoopCall(actor))
            call.experts.append(expert)
            call.token_idx.append(token_idx[start:end])
            call.slot_idx.append(slot_idx[start:end])
    return list(calls.values())


def loop_combine(hidden: torch.Tensor, routing: Routing, calls: list[LoopCall],
                 outputs: list[torch.Tensor]) -> torch.Tensor:
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


def loop_send_rows(hidden: torch.Tensor, call: LoopCall):
    """Main's marshalling of one call's rows (router_service/dispatch.py `_send`)."""
    return hidden[torch.cat(call.token_idx)].contiguous().numpy()  # [n, H]


def loop_local_run(shards: dict[Shard, GatedMLPWeights], act, layer: int, hidden: torch.Tensor,
                   routing: Routing) -> torch.Tensor:
    """Main's LocalExperts.run: one gated_mlp and one index_add_ per expert."""
    out = torch.zeros_like(hidden)  # [T, H]
    for expert in torch.unique(routing.experts[routing.experts >= 0]).tolist():
        token_idx, slot = torch.nonzero(routing.experts == expert, as_tuple=True)
        y = gated_mlp(hidden[token_idx], shards[(layer, expert)], act)  # [n, H]
        out.index_add_(0, token_idx, (y * routing.weights[token_idx, slot, None]).to(hidden.dtype))
    return out
