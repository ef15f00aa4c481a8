"""The router's observability: load statistics, Prometheus metrics and traces behind one object that the
dispatcher (per layer) and the decoder (per step) call.

- `on_layer` (RemoteExperts.run, forward thread): the routing a layer served and the calls that served it ->
  sliding-window shard/replica counts and metric accumulators. Tensor bincounts; the Python loop is per call,
  never per token.
- `on_step` (MoEDecoder's step observer, end of every forward): the step's routing per layer with the sequence
  layout (lengths, KV caches as sequence identities) -> gate entropy, top-1 switches along each sequence (exact
  across steps: the window keeps each live sequence's last top-1), active-parameter density, coverage.
- A reporter thread every `report_interval_s`: sets the health and batcher gauges and pushes `snapshot()` to the
  controller (`report_load`, fire-and-forget: never waits, never fails a request when the controller is gone).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import nullcontext

import ray
import torch
from opentelemetry import trace as otel
from opentelemetry.context import Context

from ..cluster.load_stats import LoadWindow
from ..cluster.naming import DEFAULT_MESH_ID, MeshNames
from ..experts.config import MoEModelConfig
from .metrics import RouterMetrics
from .observability_config import ObservabilityConfig

log = logging.getLogger(__name__)


class RouterObserver:
    def __init__(self, cfg: MoEModelConfig, backend, router_id: str, config: ObservabilityConfig | None = None,
                 tracer: otel.Tracer | None = None, mesh_id: str = DEFAULT_MESH_ID):
        self.config = (config or ObservabilityConfig()).validate()
        self.backend = backend
        self.router_id = router_id
        self.mesh_id = mesh_id  # whose controller gets the load reports
        self.num_experts = cfg.num_experts
        self.window = LoadWindow(list(cfg.moe_layers), cfg.num_experts, cfg.top_k, self.config.load)
        self.metrics = (RouterMetrics(list(cfg.moe_layers), cfg.num_experts, self.config.metrics)
                        if self.config.metrics.enabled and ray.is_initialized() else None)
        self.tracer = tracer
        self.batcher_gauges: Callable[[], dict] | None = None  # set by the Serve deployment
        self.placement: dict[str, str] = {}
        self._placement_refs: dict[str, ray.ObjectRef] = {}
        self._sequences: dict[int, weakref.ref] = {}
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None

    # ---- hooks (forward thread) ----------------------------------------------------------------------------

    def on_layer(self, layer: int, served, calls: list, seconds: float) -> None:
        # The dispatcher's served routing is in host memory (experts/device_rule.py): no device read here.
        slots = served.tokens_per_expert(self.num_experts).cpu().numpy()  # [E]
        replica: dict[str, int] = {}
        for call in calls:
            replica[call.actor] = replica.get(call.actor, 0) + sum(call.counts)
        identity = served.identity  # LongCat's identity-expert slots: a host routing, no device read
        self.window.record_dispatch(layer, slots, replica, degraded=served.degraded, rerouted=served.rerouted,
                                    identity=identity)
        if self.metrics is not None:
            self.metrics.record_layer(layer, slots, calls, seconds, served.rerouted, served.degraded, served.shed,
                                      identity)

    def on_retry(self, actor: str) -> None:
        if self.metrics is not None:
            self.metrics.record_retry(actor)

    def on_step(self, step_trace, lengths: list[int], caches: list) -> None:
        """After a forward: caches (one per sequence, the same object across its steps) identify sequences."""
        keys = [id(c) for c in caches]
        fresh = [k for k, c, n in zip(keys, caches, lengths) if c.length == n]  # started this step
        self.window.forget(fresh)  # an id can be reused by a new cache once the old one is freed
        for k, c in zip(keys, caches):
            self._sequences[k] = weakref.ref(c)
        dead = [k for k, ref in self._sequences.items() if ref() is None]
        if dead:
            self.window.forget(dead)
            for k in dead:
                del self._sequences[k]
        routings = step_trace.routings
        if routings:
            probs = [r.probs for r in routings.values()]
            self.window.record_step(list(routings), torch.stack([r.experts for r in routings.values()]),
                                    None if any(p is None for p in probs) else torch.stack(probs), lengths, keys)
        if self.metrics is not None and self.metrics.due():
            b = self.backend
            gauges = self.metrics.table_gauges(b.table, b.dead, b.breakers)
            if getattr(b, "shed_policy", None) is not None:
                gauges |= self.metrics.shed_gauges(b.shed_policy)
            self.metrics.flush(gauges)

    # ---- traces --------------------------------------------------------------------------------------------

    def start_request(self, carrier: dict[str, str] | None, **attributes) -> otel.Span | None:
        """The request span (child of the caller's span named by `carrier`), or None when tracing is off."""
        if self.tracer is None:
            return None
        from ..experts.telemetry import context_of

        return self.tracer.start_span("expertmesh.request", context=context_of(carrier), attributes=attributes)

    def step_span(self, parents: list[otel.Span | None], tokens: int):
        """Context manager around one forward step: a child of the only request in the step, otherwise a root
        span linked to every request's span (see experts/telemetry.py)."""
        if self.tracer is None:
            return nullcontext()
        contexts = [p.get_span_context() for p in parents if p is not None]
        attributes = {"sequences": len(parents), "tokens": tokens}
        if len(parents) == 1 and contexts:
            return self.tracer.start_as_current_span("expertmesh.step", context=otel.set_span_in_context(parents[0]),
                                                     attributes=attributes)
        return self.tracer.start_as_current_span("expertmesh.step", context=Context(), attributes=attributes,
                                                 links=[otel.Link(c) for c in contexts])

    # ---- snapshot and reporting ----------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """This router's load snapshot (cluster/load_stats.py, LoadWindow.snapshot) plus `router`."""
        self._refresh_placement()
        serving = self.backend.table.actors  # after a remap, retired actors' GPU slots are not idle GPUs
        placement = {a: slot for a, slot in self.placement.items() if a in serving}
        snap = self.window.snapshot(placement, epoch=self.backend.table.epoch)
        snap["router"] = self.router_id
        return snap

    def _refresh_placement(self) -> None:
        """actor -> GPU slot ("node/gpuN"; a CPU actor is its own slot), from each actor's `info`, asked
        without waiting: a snapshot uses what has arrived."""
        actors = getattr(self.backend.transport, "actors", None)
        if not actors or not ray.is_initialized():
            return
        for name, handle in actors.items():
            if name not in self.placement and name not in self._placement_refs:
                try:
                    self._placement_refs[name] = handle.info.remote()
                except Exception:  # a dead handle: try again next time
                    continue
        if not self._placement_refs:
            return
        ready, _ = ray.wait(list(self._placement_refs.values()), num_returns=len(self._placement_refs), timeout=0)
        done = set(ready)
        for name, ref in list(self._placement_refs.items()):
            if ref not in done:
                continue
            del self._placement_refs[name]
            try:
                info = ray.get(ref)
            except Exception:
                continue
            gpus = info.get("gpu_ids") or []
            self.placement[name] = f"{info['node_id'][:12]}/gpu{gpus[0]}" if gpus else name

    def start_reporter(self) -> None:
        if self._reporter is None:
            self._reporter = threading.Thread(target=self._report_loop, name="load-reporter", daemon=True)
            self._reporter.start()

    def stop(self) -> None:
        self._stop.set()

    def _report_loop(self) -> None:
        while not self._stop.wait(self.config.report_interval_s):
            try:
                self.report_once()
            except Exception:  # observability must never take the router down
                log.debug("load report failed", exc_info=True)

    def report_once(self) -> dict:
        snap = self.snapshot()
        if self.metrics is not None:
            self.metrics.flush()  # counters an idle router still holds (the forward thread flushes while busy)
            gauges = RouterMetrics.health_gauges(snap)
            if self.batcher_gauges is not None:
                gauges.update(self.batcher_gauges())
            for name, value in gauges.items():
                self.metrics.set_gauge(name, value)
        push_to_controller(self.router_id, snap, self.mesh_id)
        return snap


def push_to_controller(router_id: str, snapshot: dict, mesh_id: str = DEFAULT_MESH_ID) -> bool:
    """Fire-and-forget `Controller.report_load` to mesh `mesh_id`'s controller; False when there is none (nothing
    waits either way)."""
    names = MeshNames.of(mesh_id)
    try:
        controller = ray.get_actor(names.controller, namespace=names.namespace)
        controller.report_load.remote(router_id, snapshot)
        return True
    except Exception:
        return False


def default_router_id() -> str:
    import os
    import socket

    return f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"
