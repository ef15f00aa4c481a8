"""Tracing (OpenTelemetry) shared by the router and the expert actors, and the expert actor's own metrics.

Span tree of one request (names are stable; see README "Metrics and traces"):

    expertmesh.request      router replica; child of the caller's span from gRPC metadata `traceparent`
      expertmesh.step       one forward step; child of the request when it is alone in the step, otherwise a root
                            span with a link to each request's span (one step serves many requests: OpenTelemetry's
                            batch-processing pattern, so no request claims a step that others share)
        expertmesh.dispatch one MoE layer's round of expert calls (attributes: layer, calls, slots)
          expertmesh.expert inside the expert actor (attributes: actor, layer, experts, tokens); its parent arrives
                            as a W3C carrier dict (`trace=`) through Transport.submit and ExpertActor.forward

Off by default: with exporter "none" no tracer exists and callers skip every span call (`tracer is None`), so no
span objects are created. Model math does not import this module; it has no Ray import at module level.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from .tracing_config import TracingConfig

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, as gRPC metadata keys


class JsonLinesExporter(SpanExporter):
    """Appends each finished span as one JSON line (trace and span ids in hex, parent id, name, attributes).
    Several processes may share one file: each line is written with a single append."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s)) + "\n" for s in spans)
        with self._lock, open(self.path, "a") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_record(span: ReadableSpan) -> dict:
    """A flat, JSON-able view of a finished span (what the file exporter writes and tests compare)."""
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "links": [f"{link.context.span_id:016x}" for link in span.links],
        "attributes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in (span.attributes or {}).items()},
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "pid": os.getpid(),
    }


def _exporter(config: TracingConfig) -> SpanProcessor:
    if config.exporter == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter())
    if config.exporter == "file":
        return SimpleSpanProcessor(JsonLinesExporter(config.path))
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint) if config.endpoint else OTLPSpanExporter())


def build_tracer(config: TracingConfig | None, component: str,
                 processors: Sequence[SpanProcessor] = ()) -> trace.Tracer | None:
    """A tracer on a provider of its own (the process-global provider is left alone, so a test or a host
    application keeps its own), or None when tracing is off and no extra processor is given."""
    config = (config or TracingConfig()).validate()
    if not config.enabled and not processors:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name,
                                                        "expertmesh.component": component}))
    if config.enabled:
        provider.add_span_processor(_exporter(config))
    for processor in processors:
        provider.add_span_processor(processor)
    tracer = provider.get_tracer("expertmesh")
    tracer._expertmesh_provider = provider  # for flush(); the API gives no way back from a tracer
    return tracer


def flush(tracer: trace.Tracer | None) -> None:
    """Export what a batching processor still holds (call before a process exits)."""
    provider = getattr(tracer, "_expertmesh_provider", None)
    if provider is not None:
        provider.force_flush()


def carrier_of(span: trace.Span) -> dict[str, str]:
    """W3C carrier dict naming `span` as the parent (what Transport.submit's `trace=` takes)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def context_of(carrier: dict[str, str] | None) -> Context | None:
    """The parent context a carrier names, or None for an empty or missing one."""
    if not carrier:
        return None
    return propagate.extract(carrier)


def carrier_from_metadata(metadata) -> dict[str, str] | None:
    """The W3C headers among gRPC invocation metadata (pairs of key, value), or None when the caller sent none."""
    found = {k: v for k, v in (metadata or ()) if k in TRACE_HEADERS}
    return found or None


# ---- expert actor metrics (Ray's metrics API; the actor imports this, model math does not) -----------------------

EXPERT_SECONDS_BOUNDARIES = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# The tier counters (experts/tier_store.py stats) -> their metric names (router_service/metrics.py METRIC_SPECS).
TIER_COUNTERS = {"hits": "expertmesh_expert_tier_hits", "misses": "expertmesh_expert_tier_misses",
                 "bytes_moved": "expertmesh_expert_tier_bytes_moved", "stall_s": "expertmesh_expert_tier_stall_seconds"}
TIER_GAUGES = {"resident_bytes": "expertmesh_expert_resident_bytes",
               "budget_bytes": "expertmesh_expert_memory_budget_bytes"}


class ExpertMetrics:
    """`expertmesh_expert_seconds{replica}`: compute time of one ExpertActor.forward call, inside the actor
    (the dispatch histogram on the router side includes the transport; the difference is the overhead).
    With memory tiers (tiers=True), also the tier counters and gauges of TIER_COUNTERS / TIER_GAUGES."""

    def __init__(self, actor: str, tiers: bool = False):
        from ray.util.metrics import Counter, Gauge, Histogram

        self.tags = {"replica": actor}
        self.seconds = Histogram("expertmesh_expert_seconds", "Expert actor compute time per call (seconds)",
                                 boundaries=list(EXPERT_SECONDS_BOUNDARIES), tag_keys=("replica",))
        self.counters = {key: Counter(name, f"Expert memory tiers: {key} (README: Offload)", tag_keys=("replica",))
                         for key, name in TIER_COUNTERS.items()} if tiers else {}
        self.gauges = {key: Gauge(name, f"Expert memory tiers: {key} (README: Offload)", tag_keys=("replica",))
                       for key, name in TIER_GAUGES.items()} if tiers else {}
        self._last = dict.fromkeys(TIER_COUNTERS, 0)

    def observe(self, seconds: float, tier_stats: dict | None = None) -> None:
        self.seconds.observe(seconds, tags=self.tags)
        if tier_stats is None or not self.counters:
            return
        for key, counter in self.counters.items():
            delta = tier_stats[key] - self._last[key]
            if delta > 0:
                counter.inc(delta, tags=self.tags)
                self._last[key] = tier_stats[key]
        for key, gauge in self.gauges.items():
            gauge.set(tier_stats[key], tags=self.tags)
