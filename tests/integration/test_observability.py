"""Observability on one local Ray: the load snapshot counts exactly what was routed, Ray's Prometheus endpoint shows
our counters with the right labels and values, the controller merges router reports, and one traced request gives
the span tree request -> step -> dispatch -> expert across the router and the expert actors.

How the actors' spans get back to the test: the expert actors run with the `file` exporter (JSON lines under
tmp_path, one append per span, written before `forward` returns), the router with an in-memory exporter; the test
joins both on span ids. Robust across processes, and no collector actor is needed.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections import defaultdict

import pytest
import ray
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from expertmesh.cluster.controller import start_controller
from expertmesh.cluster.naming import NAMESPACE
from expertmesh.cluster.pool_spec import PoolSpec
from expertmesh.experts.telemetry import build_tracer, carrier_of, span_record
from expertmesh.experts.tracing_config import TracingConfig
from expertmesh.router_service.config import ExpertsConfig, ModelConfig
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from expertmesh.router_service.observability_config import MetricsConfig, ObservabilityConfig
from tests.clusters import init_local_ray
from tests.tiny_checkpoints import write_direct_mixtral

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
SERIES = re.compile(r"^(\w+)\{(.*)\} (\S+)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_port():
    port = free_port()
    init_local_ray(num_cpus=2, namespace=NAMESPACE, include_dashboard=False,
             _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 1000})
    yield port
    ray.shutdown()


@pytest.fixture(scope="module")
def mesh(metrics_port, tmp_path_factory):
    root = tmp_path_factory.mktemp("obs")
    model = write_direct_mixtral(root / "model", seed=3)
    spans = root / "actor_spans.jsonl"
    mesh = ExpertMesh(MeshConfig(
        model=ModelConfig(path=str(model)), experts=ExpertsConfig(layout="per-expert"),
        tracing=TracingConfig(exporter="file", path=str(spans)),
        observability=ObservabilityConfig(metrics=MetricsConfig(flush_interval_s=0.0), report_interval_s=0.5),
    ))
    mesh.spans_path = spans
    yield mesh
    mesh.shutdown()


def scrape(port: int) -> dict[str, list[tuple[dict, float]]]:
    """name -> [(labels, value)] for our series on Ray's Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list[tuple[dict, float]]] = defaultdict(list)
    for line in text.splitlines():
        m = SERIES.match(line)
        if m and m.group(1).startswith("ray_expertmesh_"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out[m.group(1)].append((labels, float(m.group(3))))
    return out


def summed(series: list[tuple[dict, float]], *keys: str) -> dict[tuple, float]:
    acc: dict[tuple, float] = defaultdict(float)
    for labels, value in series:
        acc[tuple(labels[k] for k in keys)] += value
    return dict(acc)


def test_load_snapshot_metrics_and_controller_report(mesh, metrics_port):
    cfg = mesh.model_config
    # Disable tracing for this part: it checks counts, and the trace test below makes its own spans.
    mesh.router.enable_tracing(None)
    before = mesh.router.load_snapshot()["counts"]
    out = mesh.generate(token_ids=PROMPT, max_tokens=6, stop_at_eos=False)
    mesh.score_batch([PROMPT[:5], PROMPT[2:]])
    snap = mesh.router.load_snapshot()
    json.dumps(snap, allow_nan=False)

    # Exactly what was routed: the generation's own per-layer counts plus the scored batch's (its last trace).
    expected = {layer: list(map(float, counts)) for layer, counts in out.tokens_per_expert.items()}
    for layer, routing in mesh.model.last_trace.routings.items():
        extra = routing.tokens_per_expert(cfg.num_experts).tolist()
        expected[layer] = [a + b for a, b in zip(expected[layer], extra)]
    for i, layer in enumerate(snap["layers"]):
        got = [a - b for a, b in zip(snap["counts"]["shard_load"][i], before["shard_load"][i])]
        assert got == expected[layer], f"layer {layer}"
    tokens = len(PROMPT) + 5 + 5 + 6  # prompt, 5 decode steps, the two scored sequences
    assert snap["counts"]["tokens"][0] - before["tokens"][0] == tokens
    assert sum(snap["counts"]["replica_load"].values()) == pytest.approx(sum(map(sum, snap["counts"]["shard_load"])))
    h = snap["health"]
    assert 1.0 <= h["imbalance"] <= cfg.num_experts / cfg.top_k
    assert h["active_param_density"] == pytest.approx(cfg.top_k / cfg.num_experts)  # nothing dropped
    assert 0 < h["routing_entropy"][0] <= h["routing_entropy_norm"][0] * 2  # nats vs normalised, ln 4 > 1
    assert 0.0 <= h["switch_rate"][0] <= 1.0

    # Ray's Prometheus endpoint: our counters, labelled per shard and replica, equal to the window's counts.
    want_shards = {(str(layer), str(e)): v for i, layer in enumerate(snap["layers"])
                   for e, v in enumerate(snap["counts"]["shard_load"][i]) if v}
    want_replicas = {(a,): v for a, v in snap["counts"]["replica_load"].items()}
    deadline = time.monotonic() + 60
    while True:
        series = scrape(metrics_port)
        shards = summed(series.get("ray_expertmesh_shard_tokens_total", []), "layer", "expert")
        replicas = summed(series.get("ray_expertmesh_replica_tokens_total", []), "replica")
        experts = summed(series.get("ray_expertmesh_expert_seconds_count", []), "replica")
        gauges = series.get("ray_expertmesh_load_imbalance", [])
        if (shards == want_shards and replicas == want_replicas and len(experts) == len(mesh.actors)
                and gauges) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert shards == want_shards
    assert replicas == want_replicas
    calls = {info["name"]: info["calls"] for info in mesh.actor_info()}
    assert experts == {(name,): pytest.approx(n) for name, n in calls.items()}  # warm-up is not a call
    steps = summed(series["ray_expertmesh_dispatch_seconds_count"], "layer")
    assert steps == {(str(layer),): 1.0 + 6 for layer in snap["layers"]}  # 6 generate steps + 1 scored batch
    assert {labels["replica"] for labels, v in series["ray_expertmesh_breaker_state"] if v == 0} == set(mesh.actors)
    assert {labels["layer"] for labels, _ in gauges} == {str(layer) for layer in snap["layers"]}

    # The controller receives the router's reports and merges them.
    controller = start_controller(PoolSpec(mesh.pool.spec.model_dir, "float32", mesh.pool.spec.actor_shards),
                                  mesh.slots, fresh=True)
    try:
        deadline = time.monotonic() + 30
        merged = None
        while time.monotonic() < deadline and merged is None:
            merged = ray.get(controller.load.remote())
            time.sleep(0.5)
        assert merged is not None and merged["routers"] == 1
        assert merged["counts"]["shard_load"] == mesh.router.load_snapshot()["counts"]["shard_load"]
    finally:
        ray.kill(controller, no_restart=True)


def test_span_tree_of_one_request_crosses_router_and_actors(mesh):
    memory = InMemorySpanExporter()
    mesh.router.enable_tracing(build_tracer(None, "router", [SimpleSpanProcessor(memory)]))
    mesh.spans_path.write_text("")
    client = build_tracer(None, "client", [SimpleSpanProcessor(memory)])
    with client.start_as_current_span("client") as root:
        mesh.generate(token_ids=PROMPT, max_tokens=2, stop_at_eos=False, trace=carrier_of(root))
    mesh.router.enable_tracing(None)

    spans = [span_record(s) for s in memory.get_finished_spans()]
    by_name = defaultdict(list)
    for s in spans:
        by_name[s["name"]].append(s)
    (client_span,) = by_name["client"]
    (request,) = by_name["expertmesh.request"]
    trace_id = client_span["trace_id"]
    assert request["parent_id"] == client_span["span_id"] and request["trace_id"] == trace_id
    steps = by_name["expertmesh.step"]
    assert len(steps) == 2 and all(s["parent_id"] == request["span_id"] for s in steps)
    dispatch = by_name["expertmesh.dispatch"]
    layers = mesh.model_config.moe_layers
    assert len(dispatch) == 2 * len(layers)
    step_ids = {s["span_id"] for s in steps}
    assert all(d["parent_id"] in step_ids and d["trace_id"] == trace_id for d in dispatch)
    assert sorted(d["attributes"]["layer"] for d in dispatch) == sorted(list(layers) * 2)

    actor_spans = [json.loads(line) for line in mesh.spans_path.read_text().splitlines()]
    dispatch_ids = {d["span_id"]: d for d in dispatch}
    assert actor_spans and all(a["name"] == "expertmesh.expert" for a in actor_spans)
    assert all(a["trace_id"] == trace_id and a["parent_id"] in dispatch_ids for a in actor_spans)
    # One expert span per call, each in the layer its dispatch span names.
    for a in actor_spans:
        assert a["attributes"]["layer"] == dispatch_ids[a["parent_id"]]["attributes"]["layer"]
    assert len(actor_spans) == sum(d["attributes"]["calls"] for d in dispatch)
    assert {a["pid"] for a in actor_spans}.isdisjoint({request["pid"]})  # really recorded in the actors
