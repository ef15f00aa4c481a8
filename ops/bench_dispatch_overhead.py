"""`expertmesh bench dispatch-overhead`: the router's own cost per MoE layer, without expert compute.

Per layer the router plans the calls (rows grouped by expert, split over replicas, one call per actor), marshals each
call's rows, and combines the returned outputs with the gate weights. This times exactly that at 64 tokens, for
8 experts / top-2, 128 / top-8 (Qwen3-30B-A3B's MoE) and 256 / top-8 (DeepSeek-V3's), in two ways:

  pipeline_ms      plan + marshal + combine, "before" = main's per-expert loops (ops/dispatch_loops.py) and
                   "after" = the vectorised code (router_service/dispatch_plan.py), on the same routing and layout
  remote_round_ms  a whole RemoteExperts.run (no-replica policy, breakers, plan, send, gather, combine) through an
                   in-process transport whose "experts" return their input rows: the code path a real layer takes,
                   minus the transport and the experts

for two layouts: one actor per logical expert (main's default) and one actor per device hosting a slice of every
layer (the default above 16 experts: on this CPU box one device; `devices` 8 shows a GPU node).
"""

from __future__ import annotations

import os
import platform
import time

import torch

from ..cluster.breaker import BreakerBoard
from ..cluster.routing_table import RoutingTable
from ..experts.arrays import pack, to_tensor
from ..experts.gating import route
from ..router_service.dispatch import RemoteExperts

SHAPES = [(8, 2), (128, 8), (256, 8)]  # (experts, top-k)


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


def _best_ms(fn, repeats: int, setup=None) -> float:
    """The fastest of `repeats` runs after a warm-up: on a shared machine the minimum is the code's own cost, the
    median mostly the neighbours'. setup (untimed) runs before each."""
    for _ in range(max(3, repeats // 10)):
        fn()
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(1000 * min(times), 4)


def pipeline_after(hidden, routing, table):
    from ..router_service.dispatch_plan import combine, plan_calls

    calls = plan_calls(0, routing, table)
    outputs = [to_tensor(pack(hidden[c.tokens])) for c in calls]  # marshal (as dispatch sends), echo back
    return combine(hidden, routing, calls, outputs)


def pipeline_before(hidden, routing, table):
    from .dispatch_loops import loop_combine, loop_plan_calls, loop_send_rows

    calls = loop_plan_calls(0, routing, table)
    outputs = [torch.from_numpy(loop_send_rows(hidden, c)) for c in calls]
    return loop_combine(hidden, routing, calls, outputs)


def run_overhead_bench(tokens: int = 64, hidden_size: int = 1024, repeats: int = 200, seed: int = 0,
                       threads: int = 1) -> dict:
    """-> {"shapes": {"E{experts}_top{k}": {layout: {...ms...}}}}. threads: torch threads, as a router replica's
    (router.threads, default 1)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    result: dict = {"benchmark": "dispatch-overhead", "tokens": tokens, "hidden": hidden_size, "repeats": repeats,
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                                "torch_threads": torch.get_num_threads()},
                    "shapes": {}}
    for experts, k in SHAPES:
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
