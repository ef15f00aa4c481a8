"""`expertmesh bench dispatch-overhead`: the router's own cost per MoE layer, without expert compute.

Per layer the router plans the calls (rows grouped by expert, split over replicas, one call per actor), marshals each
call's rows, and combines the returned outputs with the gate weights. This times exactly that at 64 tokens, for
8 experts / top-2, 128 / top-8 (Qwen3-30B-A3B's MoE) and 256 / top-8 (DeepSeek-V3's), in two ways:

  pipeline_ms      plan + marshal + combine, "before" = main's per-expert loops (below; the unit tests'
                   oracle too) and
                   "after" = the vectorised code (router_service/dispatch_plan.py), on the same routing and layout
  remote_round_ms  a whole RemoteExperts.run (no-replica policy, breakers, plan, send, gather, combine) through an
                   in-process transport whose "experts" return their input rows: the code path a real layer takes,
                   minus the transport and the experts

for two layouts: one actor per logical expert (main's default) and one actor per device hosting a slice of every
layer (the default above 16 experts: on this CPU box one device; `devices` 8 shows a GPU node).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ...cluster.breaker import BreakerBoard
from ...cluster.routing_table import RoutingTable, Shard, split_tokens
from ...experts.arrays import pack, to_tensor
from ...experts.gating import Routing, route
from ...router_service.dispatch import RemoteExperts
from .common import best_ms, machine_info

SHAPES = ((8, 2), (128, 8), (256, 8))  # (experts, top-k)


# --- "before": main's per-expert loops, as they were before router_service/dispatch_plan.py replaced them. Kept for
# this benchmark and as the slow obvious oracle the unit tests hold the vectorised code to, bit for bit.

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


class EchoTransport:
    """Every call returns its input rows as the experts' output: the router's side of a round, nothing else."""

    def __init__(self, actors: list[str]):
        self.actors = {name: object() for name in actors}

    def submit(self, actor, layer, experts, counts, x, **_):
        return x

    def gather_settled(self, handles, timeout):
        return [to_tensor(h) for h in handles]  # HostTensor rows, as the real transports return them


def layouts(experts: int, devices: tuple[int, ...] = (1, 8)) -> dict[str, RoutingTable]:
    """Routing tables of one MoE layer: one actor per expert, and one per device hosting a contiguous slice."""
    tables = {"actor_per_expert": RoutingTable.from_actor_shards({f"expert-e{e}-r0": [(0, e)]
                                                                 for e in range(experts)})}
    for d in devices:
        bounds = [round(i * experts / d) for i in range(d + 1)]
        tables[f"actor_per_device_{d}"] = RoutingTable.from_actor_shards(
            {f"expert-e{g}-r0": [(0, e) for e in range(bounds[g], bounds[g + 1])] for g in range(d)})
    return tables


def pipeline_after(hidden, routing, table):
    from ...router_service.dispatch_plan import combine, plan_calls

    calls = plan_calls(0, routing, table)
    outputs = [to_tensor(pack(hidden[c.tokens])) for c in calls]  # marshal (as dispatch sends), echo back
    return combine(hidden, routing, calls, outputs)


def pipeline_before(hidden, routing, table):
    calls = loop_plan_calls(0, routing, table)
    outputs = [torch.from_numpy(loop_send_rows(hidden, c)) for c in calls]
    return loop_combine(hidden, routing, calls, outputs)


@dataclass(frozen=True)
class OverheadParams:
    """tokens x hidden per layer; shapes: (experts, top-k) pairs; threads: torch threads, as a router replica's
    (router.threads, default 1)."""

    tokens: int = 64
    hidden: int = 1024
    repeats: int = 300
    seed: int = 0
    threads: int = 1
    shapes: tuple[tuple[int, int], ...] = SHAPES

    @classmethod
    def from_args(cls, args) -> OverheadParams:
        return cls(tokens=args.tokens, hidden=args.hidden, repeats=args.repeats)


def _best_ms(fn, repeats: int, setup=None) -> float:
    """common.best_ms with this benchmark's longer warm-up (its runs are microseconds) and finer rounding."""
    return best_ms(fn, repeats, warmup=max(3, repeats // 10), setup=setup, digits=4)


def run_overhead_bench(params: OverheadParams = OverheadParams()) -> dict:
    """-> {"shapes": {"E{experts}_top{k}": {layout: {...ms...}}}}."""
    tokens, hidden_size, repeats = params.tokens, params.hidden, params.repeats
    torch.set_num_threads(params.threads)
    gen = torch.Generator().manual_seed(params.seed)
    result: dict = {"benchmark": "dispatch-overhead", "tokens": tokens, "hidden": hidden_size, "repeats": repeats,
                    "machine": machine_info(torch_threads=torch.get_num_threads()), "shapes": {}}
    for experts, k in params.shapes:
        hidden = torch.randn(tokens, hidden_size, generator=gen)  # [T, H]
        routing = route(torch.randn(tokens, experts, generator=gen), k, renormalize=True)
        per_layout = {}
        for name, table in layouts(experts).items():
            backend = RemoteExperts(table, EchoTransport(list(table.actors)))

            def fresh_breakers():
                # A breaker keeps every outcome of its window (cluster/breaker.py) and scans it on each record:
                # thousands of rounds a second would time that scan, not a layer.
                backend.breakers = BreakerBoard()  # noqa: B023

            row: dict = {"remote_round_ms": _best_ms(lambda: backend.run(0, hidden, routing), repeats,  # noqa: B023
                                                     fresh_breakers)}
            row["calls"] = backend.calls_per_layer[0]
            after = pipeline_after(hidden, routing, table)
            before = pipeline_before(hidden, routing, table)
            row["pipeline_after_ms"] = _best_ms(lambda: pipeline_after(hidden, routing, table), repeats)  # noqa: B023
            row["pipeline_before_ms"] = _best_ms(lambda: pipeline_before(hidden, routing, table), repeats)  # noqa: B023
            row["speedup"] = round(row["pipeline_before_ms"] / row["pipeline_after_ms"], 2)
            row["bit_identical"] = bool(torch.equal(after, before))
            per_layout[name] = row
        result["shapes"][f"E{experts}_top{k}"] = per_layout
    return result
