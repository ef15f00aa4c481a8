"""`expertmesh bench observability`: what load statistics and tracing cost the router, in process, without Ray.

The dispatcher runs a whole layer round against an echo transport (dispatch_overhead.EchoTransport: the "experts"
return their input rows), so no expert compute and no transport is in it: the round with tracing off and on (span +
W3C context injection, in-memory exporter; their difference is what tracing costs), the observer's per-layer hook,
and its per-step hook (all MoE layers of one decode step at once). Best of several repeats.

(The round used to be replaced by a no-op through RemoteExperts._run; since the dispatcher split a layer into
submit and wait that hook is gone, so the round is now the router's real one, minus experts and transport.)
"""

from __future__ import annotations

import timeit
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ObservabilityParams:
    """The decode step timed: `sequences` sequences through `layers` MoE layers of `experts` experts, top_k."""

    layers: int = 4
    experts: int = 8
    top_k: int = 2
    sequences: int = 32
    repeats: int = 5

    @classmethod
    def from_args(cls, args) -> ObservabilityParams:
        return cls(sequences=args.sequences)


class _Cfg:
    def __init__(self, layers: int, experts: int, top_k: int):
        self.moe_layers = tuple(range(layers))
        self.num_experts = experts
        self.top_k = top_k


def run_observability_bench(params: ObservabilityParams = ObservabilityParams()) -> dict:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ...cluster.breaker import BreakerBoard
    from ...cluster.routing_table import RoutingTable
    from ...experts.gating import route
    from ...experts.kv_cache import PagedKVPool
    from ...experts.modeling import StepTrace
    from ...experts.telemetry import build_tracer
    from ...router_service.dispatch import RemoteExperts
    from ...router_service.dispatch_plan import plan_calls
    from ...router_service.observability import RouterObserver
    from .dispatch_overhead import EchoTransport

    layers, experts, top_k, sequences, repeats = (params.layers, params.experts, params.top_k, params.sequences,
                                                  params.repeats)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    table = RoutingTable.from_actor_shards({f"expert-e{e}-r0": [(layer, e) for layer in range(layers)]
                                            for e in range(experts)})
    hidden = torch.randn(sequences, 16, generator=gen)
    routing = route(torch.randn(sequences, experts, generator=gen), top_k, True)

    def backend(tracer=None) -> RemoteExperts:
        b = RemoteExperts(table, EchoTransport(list(table.actors)))
        b.tracer = tracer
        return b

    def best(fn, number: int, b: RemoteExperts | None = None) -> float:
        # A breaker keeps every outcome of its window and scans it on each record: fresh ones per repeat, so
        # thousands of rounds a second time the round, not that scan.
        setup = (lambda: setattr(b, "breakers", BreakerBoard())) if b is not None else "pass"
        return min(timeit.repeat(fn, setup=setup, number=number, repeat=repeats)) / number * 1e6

    off = backend()
    spans = InMemorySpanExporter()
    on = backend(build_tracer(None, "bench", [SimpleSpanProcessor(spans)]))
    result = {
        "dispatch_tracing_off_us_per_layer": best(lambda: off.run(0, hidden, routing), 500, off),
        "dispatch_tracing_on_us_per_layer": best(lambda: on.run(0, hidden, routing), 500, on),
    }
    result["dispatch_tracing_cost_us_per_layer"] = (result["dispatch_tracing_on_us_per_layer"]
                                                    - result["dispatch_tracing_off_us_per_layer"])
    spans.clear()
    observed = backend()
    observer = RouterObserver(_Cfg(layers, experts, top_k), observed, "bench")
    calls = plan_calls(0, routing, table)
    result["observer_us_per_layer"] = best(lambda: observer.on_layer(0, routing, calls, 0.001), 2000)
    step = StepTrace(routings={layer: routing for layer in range(layers)})
    pool = PagedKVPool([{"k": (1,)}], num_blocks=sequences, block_size=8, dtype=torch.float32)
    caches = [pool.new_sequence() for _ in range(sequences)]
    for cache in caches:
        cache.length = 8  # decode: every sequence has history
    result["observer_us_per_step"] = best(lambda: observer.on_step(step, [1] * sequences, caches), 500)
    result = {k: round(v, 2) for k, v in result.items()}
    result["setup"] = {"moe_layers": layers, "experts": experts, "top_k": top_k, "sequences_per_step": sequences,
                       "metrics": "off (no Ray here; with Ray the recorder adds numpy adds per layer and one flush/s)"}
    return result
