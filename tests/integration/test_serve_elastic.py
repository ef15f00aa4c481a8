"""`expertmesh serve --elastic` on a Cluster that declares GPUs, driven over gRPC like a user would: the server
starts one actor per GPU, the skewed traffic of the embedded model makes the controller rebalance live, no request
fails, every answer equals the reference, and `GetClusterState` (what `expertmesh status` prints) shows the GPU
imbalance before and after. Also `expertmesh plan` -> `serve --placement` on the same cluster, and the refusal of a
placement planned for another cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
import ray

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.tokenizer import load_tokenizer
from expertmesh.protos import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from expertmesh.protos import inference_pb2 as pb
from tests.clusters import FAKE_GPU_FLAGS, start_cluster
from tests.served import start_server
from tests.tiny_checkpoints import greedy_tokens
from tests.traffic import MAX_TOKENS, code_prompts

# A drill-length module (minutes of Ray, servers and kills): in CI's default set again (CI's limit is 90 minutes;
# the whole run stays well under 45).


@pytest.fixture(scope="module")
def gpu_cluster():
    cluster, _ = start_cluster({"num_cpus": 2, "num_gpus": 0, "include_dashboard": False},
                               [{"num_cpus": 2, "num_gpus": 1}] * 2)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def prompts_and_expected():
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    prompts = [tokenizer.encode(t).ids[:24] for t in code_prompts()]
    reference = load_reference_model(EMBEDDED_MODEL_DIR)
    return prompts, [greedy_tokens(reference, p, MAX_TOKENS) for p in prompts]


def generate(stub, ids: list[int]) -> list[int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=MAX_TOKENS, ignore_eos=True)
    out = []
    for message in stub.Generate(request, timeout=120):
        if message.HasField("token"):
            out.extend(message.token.token_ids)
    return out


def cluster_state(chan) -> admin_pb2.ClusterState:
    return admin_pb2_grpc.AdminStub(chan).GetClusterState(admin_pb2.ClusterStateRequest(), timeout=30)


def test_served_elastic_rebalances_without_failing_a_request(gpu_cluster, prompts_and_expected):
    prompts, expected = prompts_and_expected
    server = start_server(*FAKE_GPU_FLAGS, "--address", gpu_cluster.address, "--elastic", "--slots-per-gpu", "5",
                          "--control-interval", "2")
    try:
        with grpc.insecure_channel(server.target) as chan:
            stub = inference_pb2_grpc.InferenceStub(chan)
            start = cluster_state(chan)
            assert sorted(r.actor for r in start.replicas) == ["expert-g0-v0", "expert-g1-v0"]
            failures, served = [], 0

            def remapped() -> bool:
                return any("remap" in e for e in json.loads(cluster_state(chan).control_json or "[]"))

            # Cycle through the prompts (every answer checked) until the controller has rebalanced, then a bit more.
            i, after = 0, None
            while after is None or i < after + len(prompts):
                k = i % len(prompts)
                try:
                    got = generate(stub, prompts[k])
                    served += 1
                    if got != expected[k]:
                        failures.append(f"prompt {k}: {got} != {expected[k]}")
                except grpc.RpcError as exc:
                    failures.append(f"prompt {k}: {exc.code()} {exc.details()}")
                i += 1
                if after is None and i % 8 == 0 and remapped():
                    after = i
                assert i < 400, "no rebalance after 400 requests"
            assert not failures, failures[:5]
            control = json.loads(cluster_state(chan).control_json)
            remap = next(e for e in control if "remap" in e)
            assert remap["remap"]["ok"] and max(remap["imbalance_after"]) < max(remap["imbalance_before"])
            assert max(remap["imbalance_after"]) <= 1.15
            state = cluster_state(chan)
            assert state.epoch >= remap["remap"]["epoch"]
            started = {r.actor for r in start.replicas}
            if len([e for e in control if "remap" in e]) == 1:
                assert {r.actor for r in state.replicas} == (started - set(remap["remap"]["retired"])
                                                             | set(remap["remap"]["added"]))
        # The status command renders the control steps.
        status = subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", "status", "--target", server.target],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "elastic:" in status.stdout and "GPU imbalance" in status.stdout and "->" in status.stdout
    finally:
        assert server.stop() == 0, server.log()
    ray.init(address=gpu_cluster.address)
    try:
        from expertmesh.cluster.naming import NAMESPACE

        left = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
        assert left == [], left  # every expert actor, including those a remap started, stopped with the server
    finally:
        ray.shutdown()


def test_plan_then_serve_from_the_placement(gpu_cluster, prompts_and_expected, tmp_path):
    prompts, expected = prompts_and_expected
    load = tmp_path / "load.json"
    load.write_text(json.dumps({"load": [[1, 9, 1, 8, 1, 1, 2, 1]] * 4}))  # two hot experts per layer
    placement = tmp_path / "placement.json"
    planned = subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", "plan", "--load", str(load), "--gpus", "2",
                              "--nodes", "2", "--slots-per-gpu", "5", "--out", str(placement)],
                             capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr
    doc = json.loads(placement.read_text())
    hosted = sum(len(g) for g in doc["gpus"])
    assert hosted > 4 * 8  # hot experts got a replica on the other GPU

    server = start_server(*FAKE_GPU_FLAGS, "--address", gpu_cluster.address, "--placement", str(placement))
    try:
        with grpc.insecure_channel(server.target) as chan:
            stub = inference_pb2_grpc.InferenceStub(chan)
            for k in range(3):
                assert generate(stub, prompts[k]) == expected[k]
            state = cluster_state(chan)
            assert sorted(r.actor for r in state.replicas) == ["expert-g0-v0", "expert-g1-v0"]
            assert sum(len(s.replicas) for s in state.shards) == hosted
    finally:
        assert server.stop() == 0, server.log()

    wrong = tmp_path / "wrong.json"
    subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", "plan", "--load", str(load), "--gpus", "4",
                    "--nodes", "2", "--slots-per-gpu", "5", "--out", str(wrong)], check=True, timeout=120,
                   capture_output=True)
    refused = subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", "serve", "--port", "0", "--address",
                              gpu_cluster.address, "--placement", str(wrong)], capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and "placement" in refused.stderr and "Traceback" not in refused.stderr
