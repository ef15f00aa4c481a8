"""Prometheus metrics through Ray's metrics API (`ray.util.metrics`): every name expertmesh exports, in one place.

Ray's exporter prefixes each name with `ray_`; counters get `_total`, histograms `_bucket` / `_sum` / `_count`
(`MetricSpec.prometheus_names`). Ray adds its own labels (`NodeAddress`, `WorkerId`, `SessionName`, ...), so
series of different router replicas never collide; PromQL sums them.

Labels stay bounded: per shard (`layer`, `expert`), per replica (actor name) or per layer — never per request or
token. Above `MetricsConfig.max_shard_labels` shards (or with `per_shard_labels=False`) the shard metrics aggregate
per layer (`expert="all"`; live replicas then report the layer's minimum), for models with thousands of shards.

Recording is cheap: the dispatcher adds a layer's counts into numpy/dict accumulators (no Ray call); `flush` hands
the deltas to Ray at most every `flush_interval_s` (one inc per non-zero series), and sets the gauges.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..experts.telemetry import EXPERT_SECONDS_BOUNDARIES
from .observability_config import MetricsConfig

DISPATCH_SECONDS_BOUNDARIES = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # counter | gauge | histogram
    description: str
    tags: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()

    @property
    def prometheus_names(self) -> list[str]:
        """The series names Prometheus sees from Ray's exporter."""
        base = f"ray_{self.name}"
        if self.kind == "counter":
            return [f"{base}_total"]
        if self.kind == "histogram":
            return [f"{base}_bucket", f"{base}_sum", f"{base}_count"]
        return [base]


_SHARD = ("layer", "expert")
METRIC_SPECS: dict[str, MetricSpec] = {s.name: s for s in [
    MetricSpec("expertmesh_shard_tokens", "counter", "Token slots routed to a shard (layer, expert)", _SHARD),
    MetricSpec("expertmesh_shard_calls", "counter", "Expert calls that carried a shard's tokens", _SHARD),
    MetricSpec("expertmesh_replica_tokens", "counter", "Token slots an expert replica (actor) served", ("replica",)),
    MetricSpec("expertmesh_replica_calls", "counter", "Calls an expert replica (actor) served", ("replica",)),
    MetricSpec("expertmesh_retried_calls", "counter", "Expert calls that failed and were re-sent elsewhere",
               ("replica",)),
    MetricSpec("expertmesh_rerouted_tokens", "counter", "Slots moved to a next-best expert by the capacity cap",
               ("layer",)),
    MetricSpec("expertmesh_degraded_tokens", "counter", "Slots moved off an expert with no live replica (degrade)",
               ("layer",)),
    MetricSpec("expertmesh_shed_tokens", "counter", "Slots moved off an overloaded expert (overload shedding)",
               ("layer",)),
    MetricSpec("expertmesh_identity_tokens", "counter", "Slots an identity (zero-compute) expert took, computed on "
               "the router with no expert call (LongCat-Flash)", ("layer",)),
    MetricSpec("expertmesh_dispatch_seconds", "histogram", "One MoE layer's round of expert calls, router side",
               ("layer",), DISPATCH_SECONDS_BOUNDARIES),
    MetricSpec("expertmesh_expert_seconds", "histogram", "Expert actor compute time per call (inside the actor)",
               ("replica",), EXPERT_SECONDS_BOUNDARIES),
    MetricSpec("expertmesh_expert_tier_hits", "counter", "Shards an expert call found in its actor's device tier",
               ("replica",)),
    MetricSpec("expertmesh_expert_tier_misses", "counter", "Shards an expert call had to load (or wait for)",
               ("replica",)),
    MetricSpec("expertmesh_expert_tier_bytes_moved", "counter", "Bytes loaded from the lower tier into the device tier",
               ("replica",)),
    MetricSpec("expertmesh_expert_tier_stall_seconds", "counter", "Time expert calls waited on shard loads",
               ("replica",)),
    MetricSpec("expertmesh_expert_resident_bytes", "gauge", "Expert weight bytes in an actor's device tier",
               ("replica",)),
    MetricSpec("expertmesh_expert_memory_budget_bytes", "gauge", "An actor's device budget for expert weights",
               ("replica",)),
    MetricSpec("expertmesh_breaker_state", "gauge", "Circuit breaker per replica: 0 closed, 1 half-open, 2 open",
               ("replica",)),
    MetricSpec("expertmesh_live_replicas", "gauge", "Live replicas of a shard (per layer: the minimum)", _SHARD),
    MetricSpec("expertmesh_shard_utilization", "gauge", "Offered slots over live replicas x capacity in the last "
               "expert round (overload shedding on; per layer: the maximum)", _SHARD),
    MetricSpec("expertmesh_shedding", "gauge", "1 while a shard sheds load (per layer: shards shedding)", _SHARD),
    MetricSpec("expertmesh_routing_epoch", "gauge", "Routing-table epoch the router serves"),
    MetricSpec("expertmesh_queue_depth", "gauge", "Requests waiting to join the batch"),
    MetricSpec("expertmesh_active_sequences", "gauge", "Sequences decoding together"),
    MetricSpec("expertmesh_kv_cache_sequences", "gauge", "Sequences holding a KV cache"),
    MetricSpec("expertmesh_kv_cache_bytes", "gauge", "Bytes held by KV caches"),
    MetricSpec("expertmesh_kv_blocks_free", "gauge", "Paged KV cache blocks free"),
    MetricSpec("expertmesh_kv_blocks_total", "gauge", "Paged KV cache blocks in all"),
    MetricSpec("expertmesh_kv_blocks_cached", "gauge", "Paged KV cache blocks a prefix lookup can find (held or free)"),
    MetricSpec("expertmesh_prefix_cache_hit_rate", "gauge", "Share of admitted prompt tokens served from the prefix "
               "cache since start"),
    MetricSpec("expertmesh_prefetch_hints", "gauge", "Gate prefetch hints: 1 sent, 0 withheld by the prefetch "
               "governor (its last measurement found decode steps faster without them), -1 measuring before its "
               "first verdict; absent with prefetch off"),
    MetricSpec("expertmesh_expert_shards_per_request", "gauge", "Distinct (layer, expert) shards the steps called, "
               "over finished requests, since start (expert loads per request)"),
    MetricSpec("expertmesh_load_std", "gauge", "Std-dev of shard load across a layer's experts (window)", ("layer",)),
    MetricSpec("expertmesh_load_imbalance", "gauge", "max/mean shard load across a layer's experts (window)",
               ("layer",)),
    MetricSpec("expertmesh_gpu_imbalance", "gauge", "max/mean load across GPU slots (window)"),
    MetricSpec("expertmesh_routing_entropy", "gauge", "Mean gate entropy per token, nats (window)", ("layer",)),
    MetricSpec("expertmesh_switch_rate", "gauge", "Share of consecutive tokens whose top-1 expert changes",
               ("layer",)),
    MetricSpec("expertmesh_active_param_density", "gauge", "Share of a layer's routed-expert parameters a token "
               "touches (window)"),
    MetricSpec("expertmesh_expert_coverage", "gauge", "Share of a layer's experts one step hits (window)",
               ("layer",)),
]}

# Created inside the expert actors (experts/telemetry.py ExpertMetrics), not by a router.
ACTOR_METRICS = frozenset({"expertmesh_expert_seconds", "expertmesh_expert_tier_hits", "expertmesh_expert_tier_misses",
                           "expertmesh_expert_tier_bytes_moved", "expertmesh_expert_tier_stall_seconds",
                           "expertmesh_expert_resident_bytes", "expertmesh_expert_memory_budget_bytes"})


def _make(spec: MetricSpec):
    from ray.util import metrics

    if spec.kind == "counter":
        return metrics.Counter(spec.name, spec.description, tag_keys=spec.tags)
    if spec.kind == "gauge":
        return metrics.Gauge(spec.name, spec.description, tag_keys=spec.tags)
    return metrics.Histogram(spec.name, spec.description, boundaries=list(spec.boundaries), tag_keys=spec.tags)


class RouterMetrics:
    """Accumulates one router's counts between flushes and hands them to Ray. Called from the forward thread."""

    def __init__(self, layers: list[int], num_experts: int, config: MetricsConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = (config or MetricsConfig()).validate()
        self.layers = list(layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts = num_experts
        self.per_shard = self.config.shard_labels(len(self.layers) * num_experts)
        self.clock = clock
        self.m = {name: _make(spec) for name, spec in METRIC_SPECS.items() if name not in ACTOR_METRICS}
        self._last_flush = clock()
        # The forward thread records; the forward thread (when due) and the reporter thread (so an idle router's
        # last counts still reach Ray) flush. The lock only guards swapping the accumulators.
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        n, e = len(self.layers), self.num_experts
        self._shard_tokens = np.zeros((n, e))
        self._shard_calls = np.zeros((n, e))
        self._replica_tokens: dict[str, float] = {}
        self._replica_calls: dict[str, float] = {}
        self._retried: dict[str, float] = {}
        self._rerouted = np.zeros(n)
        self._degraded = np.zeros(n)
        self._shed = np.zeros(n)
        self._identity = np.zeros(n)
        self._dispatch: list[tuple[int, float]] = []

    def record_layer(self, layer: int, expert_slots: np.ndarray, calls: list, seconds: float,
                     rerouted: int = 0, degraded: int = 0, shed: int = 0, identity: int = 0) -> None:
        """One layer's round: expert_slots [E]; calls: the ActorCalls that served (actor, experts, counts)."""
        r = self.row[layer]
        with self._lock:
            self._shard_tokens[r] += expert_slots
            for call in calls:
                self._shard_calls[r, call.experts] += 1
                self._replica_calls[call.actor] = self._replica_calls.get(call.actor, 0.0) + 1
                self._replica_tokens[call.actor] = self._replica_tokens.get(call.actor, 0.0) + sum(call.counts)
            self._rerouted[r] += rerouted
            self._degraded[r] += degraded
            self._shed[r] += shed
            self._identity[r] += identity
            self._dispatch.append((layer, seconds))

    def record_retry(self, actor: str) -> None:
        with self._lock:
            self._retried[actor] = self._retried.get(actor, 0.0) + 1

    def due(self) -> bool:
        return self.clock() - self._last_flush >= self.config.flush_interval_s

    def flush(self, gauges: dict | None = None) -> None:
        """Send the accumulated deltas and set gauges. gauges: name (without tags) -> value, or -> {tags: value}
        given as {(("layer", "0"),): 1.0}."""
        with self._lock:
            self._last_flush = self.clock()
            shard_tokens, shard_calls = self._shard_tokens, self._shard_calls
            replica_tokens, replica_calls, retried = self._replica_tokens, self._replica_calls, self._retried
            rerouted, degraded, shed, dispatch = self._rerouted, self._degraded, self._shed, self._dispatch
            identity = self._identity
            self._reset()
        m = self.m
        for name, acc in (("expertmesh_shard_tokens", shard_tokens), ("expertmesh_shard_calls", shard_calls)):
            if self.per_shard:
                for r, e in zip(*np.nonzero(acc)):
                    m[name].inc(float(acc[r, e]), tags={"layer": str(self.layers[r]), "expert": str(e)})
            else:
                for r, total in enumerate(acc.sum(axis=1)):
                    if total:
                        m[name].inc(float(total), tags={"layer": str(self.layers[r]), "expert": "all"})
        for name, acc in (("expertmesh_replica_tokens", replica_tokens), ("expertmesh_replica_calls", replica_calls),
                          ("expertmesh_retried_calls", retried)):
            for actor, value in acc.items():
                if value:
                    m[name].inc(value, tags={"replica": actor})
        for name, acc in (("expertmesh_rerouted_tokens", rerouted), ("expertmesh_degraded_tokens", degraded),
                          ("expertmesh_shed_tokens", shed), ("expertmesh_identity_tokens", identity)):
            for r in np.nonzero(acc)[0]:
                m[name].inc(float(acc[r]), tags={"layer": str(self.layers[r])})
        for layer, seconds in dispatch:
            m["expertmesh_dispatch_seconds"].observe(seconds, tags={"layer": str(layer)})
        for name, value in (gauges or {}).items():
            self.set_gauge(name, value)

    def set_gauge(self, name: str, value) -> None:
        """value: a number, or {((tag, value), ...): number} for a gauge with tags."""
        if isinstance(value, dict):
            for tags, v in value.items():
                self.m[name].set(float(v), tags=dict(tags))
        else:
            self.m[name].set(float(value))

    def table_gauges(self, table, dead: set[str], breakers) -> dict:
        """Breaker state per replica and live replicas per shard (or the per-layer minimum)."""
        breaker = {(("replica", a),): BREAKER_VALUES.get(breakers.get(a).state, 0) for a in sorted(table.actors)}
        live = np.zeros((len(self.layers), self.num_experts))
        for (layer, expert), replicas in table.replicas.items():
            if layer in self.row:
                live[self.row[layer], expert] = sum(
                    1 for a in replicas if a not in dead and breakers.get(a).state != "open")
        if self.per_shard:
            live_tags = {(("layer", str(self.layers[r])), ("expert", str(e))): live[r, e]
                         for r in range(len(self.layers)) for e in range(self.num_experts)}
        else:
            live_tags = {(("layer", str(self.layers[r])), ("expert", "all")): live[r].min()
                         for r in range(len(self.layers))}
        return {"expertmesh_breaker_state": breaker, "expertmesh_live_replicas": live_tags,
                "expertmesh_routing_epoch": table.epoch}

    def shed_gauges(self, policy) -> dict:
        """Overload shedding's state (router_service/shedding.py ShedPolicy): utilisation and shedding per shard,
        or per layer the maximum utilisation and the number of shards shedding."""
        util, shedding = {}, {}
        for layer, (u, on) in policy.gauges().items():
            if layer not in self.row:
                continue
            if self.per_shard:
                for e in range(self.num_experts):
                    tags = (("layer", str(layer)), ("expert", str(e)))
                    util[tags], shedding[tags] = float(u[e]), float(on[e])
            else:
                tags = (("layer", str(layer)), ("expert", "all"))
                util[tags], shedding[tags] = float(u.max()), float(on.sum())
        return {"expertmesh_shard_utilization": util, "expertmesh_shedding": shedding}

    @staticmethod
    def health_gauges(snapshot: dict) -> dict:
        """The routing health metrics of a load snapshot as gauges."""
        h = snapshot["health"]
        per_layer = {"expertmesh_load_std": "load_std", "expertmesh_load_imbalance": "imbalance_per_layer",
                     "expertmesh_routing_entropy": "routing_entropy", "expertmesh_switch_rate": "switch_rate",
                     "expertmesh_expert_coverage": "expert_coverage"}
        out: dict = {name: {(("layer", str(layer)),): v for layer, v in zip(snapshot["layers"], h[key])}
                     for name, key in per_layer.items()}
        out["expertmesh_gpu_imbalance"] = h["gpu_imbalance"]
        out["expertmesh_active_param_density"] = h["active_param_density"]
        return out
