"""The served path: a `traceparent` sent as gRPC metadata to `expertmesh serve --trace file` gives one trace from
the client's span through the router replica (request, step, dispatch) into the expert actors; `expertmesh status`
shows the load statistics with the imbalance. The server writes every process's spans to one JSON-lines file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from expertmesh.experts.telemetry import build_tracer, carrier_of
from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc
from tests.served import ONE_ACTOR, start_server
from tests.tiny_checkpoints import write_direct_mixtral

PROMPT = [5, 17, 29, 41, 53]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_obs")
    model = write_direct_mixtral(root / "model", seed=5)
    spans = root / "spans.jsonl"
    server = start_server(*ONE_ACTOR, "--model", str(model), "--trace", "file", "--trace-file", str(spans))
    server.spans = spans
    yield server
    assert server.stop() == 0, server.log()


def test_traceparent_from_grpc_metadata_reaches_the_expert_actors(served):
    memory = InMemorySpanExporter()
    client = build_tracer(None, "client", [SimpleSpanProcessor(memory)])
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_tokens=3, ignore_eos=True)
    with grpc.insecure_channel(served.target) as chan, client.start_as_current_span("client") as root:
        metadata = tuple(carrier_of(root).items())
        messages = list(inference_pb2_grpc.InferenceStub(chan).Generate(request, metadata=metadata, timeout=120))
    assert messages[-1].HasField("done")
    trace_id = f"{root.get_span_context().trace_id:032x}"

    deadline = time.monotonic() + 30  # the request span ends after the stream's last message
    while True:
        spans = [json.loads(line) for line in served.spans.read_text().splitlines()] if served.spans.exists() else []
        mine = [s for s in spans if s["trace_id"] == trace_id]
        if any(s["name"] == "expertmesh.request" for s in mine) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    by_name = defaultdict(list)
    for s in mine:
        by_name[s["name"]].append(s)
    (req,) = by_name["expertmesh.request"]
    assert req["parent_id"] == f"{root.get_span_context().span_id:016x}"
    steps = by_name["expertmesh.step"]
    assert len(steps) == 3 and all(s["parent_id"] == req["span_id"] for s in steps)  # alone in each step
    step_ids = {s["span_id"] for s in steps}
    dispatch = by_name["expertmesh.dispatch"]
    assert len(dispatch) == 3 * 2 and all(d["parent_id"] in step_ids for d in dispatch)  # 2 MoE layers
    dispatch_ids = {d["span_id"] for d in dispatch}
    experts = by_name["expertmesh.expert"]
    assert len(experts) == sum(d["attributes"]["calls"] for d in dispatch)
    assert all(e["parent_id"] in dispatch_ids for e in experts)
    assert {e["pid"] for e in experts}.isdisjoint({req["pid"]})  # recorded in the actors, not the router


def test_status_shows_load_and_imbalance(served):
    run = subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", "status", "--target", served.target],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "max/mean imbalance" in run.stdout and "slots per expert" in run.stdout, run.stdout
    run = subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", "status", "--target", served.target, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    state = json.loads(run.stdout)
    load = state["load"]
    assert load["layers"] == [0, 1] and load["num_experts"] == 4
    assert sum(map(sum, load["counts"]["shard_load"])) > 0  # the traced request above was counted
    assert load["health"]["imbalance"] >= 1.0
