"""Two `expertmesh serve` processes on one Ray cluster with different mesh ids (--mesh-id alpha / beta) serving
two models: each Serve application, controller and pool is its own mesh's, each answers exactly like its reference,
and killing an expert actor of one (by name, in its namespace, from this driver) leaves the other's actors and
answers alone while the first restores it. One `expertmesh front --all-meshes` over both serves each model from its own
mesh (gRPC by the request's model field, HTTP by `model`), lists both models, refuses an unknown one naming `model`,
and keeps answering the other model unchanged while one mesh restores a killed actor."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import ray

from expertmesh.cluster.naming import MeshNames
from expertmesh.experts.reference import load_reference_model
from expertmesh.ops.server_process import start_server as start_process
from expertmesh.protos import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from expertmesh.protos import inference_pb2 as pb
from tests.clusters import init_local_ray
from tests.served import generate_ids, start_server
from tests.tiny_checkpoints import greedy_tokens
from tests.traffic import kill_and_wait, wait_for

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
MAX_TOKENS = 6
MODELS = {"alpha": "mixtral", "beta": "qwen2_moe"}  # mesh id -> checkpoint
RESTORE_S = 60


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[int]]:
    return {mesh_id: greedy_tokens(load_reference_model(checkpoints[family]), PROMPT, MAX_TOKENS)
            for mesh_id, family in MODELS.items()}


@pytest.fixture(scope="module")
def servers(checkpoints):
    init_local_ray(num_cpus=4, namespace=MeshNames.of().namespace, include_dashboard=False)
    started = {}
    try:
        address = ray.get_runtime_context().gcs_address
        for mesh_id, family in MODELS.items():
            started[mesh_id] = start_server("--address", address, "--mesh-id", mesh_id, "--model",
                                            str(checkpoints[family]), "--cpus-per-actor", "0.25")
        yield started
    finally:
        for server in started.values():
            assert server.stop() == 0, server.log()
        ray.shutdown()


@pytest.fixture(scope="module")
def front(servers):
    """`expertmesh front --all-meshes` over the two meshes (it finds them among Serve's applications)."""
    started = start_process(["--address", ray.get_runtime_context().gcs_address, "--all-meshes", "--http-port", "0"],
                            command="front", timeout=120)
    try:
        yield started
    finally:
        assert started.stop() == 0, started.log()


def model_of(mesh_id: str, checkpoints) -> str:
    return checkpoints[MODELS[mesh_id]].name  # each server serves its checkpoint folder's name


def ask_front(front, model: str, prompt: list[int] = PROMPT) -> list[int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, model=model)
    with grpc.insecure_channel(front.target) as chan:
        return [t for m in inference_pb2_grpc.InferenceStub(chan).Generate(request, timeout=60)
                if m.HasField("token") for t in m.token.token_ids]


def http(front, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{front.http_url}{path}", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def ask(server, prompt: list[int] = PROMPT) -> list[int]:
    with grpc.insecure_channel(server.target) as chan:
        return generate_ids(chan, prompt, MAX_TOKENS)


def cluster_state(server) -> admin_pb2.ClusterState:
    with grpc.insecure_channel(server.target) as chan:
        return admin_pb2_grpc.AdminStub(chan).GetClusterState(admin_pb2.ClusterStateRequest(), timeout=30)


def actor_ids(mesh_id: str) -> dict[str, str]:
    namespace = MeshNames.of(mesh_id).namespace
    return {a["name"]: ray.get_actor(a["name"], namespace=namespace)._actor_id.hex()
            for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace}


def test_one_front_serves_each_model_from_its_own_mesh(front, expected, checkpoints):
    models = {mesh_id: model_of(mesh_id, checkpoints) for mesh_id in MODELS}
    assert front.model_name == ",".join(models.values())  # the ready line names every model it serves
    for mesh_id, model in models.items():
        assert ask_front(front, model) == expected[mesh_id], mesh_id
    status, listed = http(front, "/v1/models")
    assert status == 200 and sorted(m["id"] for m in listed["data"]) == sorted(models.values())
    # HTTP by `model`: greedy, with the chosen tokens' log-probabilities, which only that model gives (checked
    # against Score through the same front, routed by its model field).
    for mesh_id, model in models.items():
        status, body = http(front, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                       "temperature": 0, "logprobs": 0})
        assert status == 200 and body["model"] == model and body["usage"]["completion_tokens"] == MAX_TOKENS
        with grpc.insecure_channel(front.target) as chan:
            scored = inference_pb2_grpc.InferenceStub(chan).Score(
                pb.ScoreRequest(token_ids=PROMPT + expected[mesh_id], log_probs=True, model=model), timeout=60)
        rows = [scored.values[i * scored.vocab_size:(i + 1) * scored.vocab_size] for i in range(scored.seq_len)]
        want = [rows[len(PROMPT) - 1 + i][t] for i, t in enumerate(expected[mesh_id])]
        assert body["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-3), mesh_id
    # A model no mesh serves: OpenAI's 404 naming `model`; gRPC NOT_FOUND naming the field. The same through the
    # unmodified `openai` client, which also lists both models.
    status, body = http(front, "/v1/completions", {"model": "gpt-4", "prompt": PROMPT, "max_tokens": 1})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    client = openai.OpenAI(base_url=f"{front.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert sorted(m.id for m in client.models.list()) == sorted(models.values())
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
    assert not_found.value.code == "model_not_found" and not_found.value.param == "model"
    reply = client.completions.create(model=models["beta"], prompt=PROMPT, max_tokens=2, temperature=0)
    assert reply.model == models["beta"] and reply.usage.completion_tokens == 2
    with pytest.raises(grpc.RpcError) as err:
        ask_front(front, "gpt-4")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details().startswith("model:")


def test_two_served_meshes_kill_in_one(servers, expected, front, checkpoints):
    from ray import serve
    from ray.serve import context as serve_context

    # An earlier module's Serve client (this process, another Ray) is cached: forget it, find this cluster's.
    serve_context._global_client = None
    apps = set(serve.status().applications)
    assert {"expertmesh-alpha", "expertmesh-beta"} <= apps and "expertmesh" not in apps
    for mesh_id, server in servers.items():
        assert ask(server) == expected[mesh_id], mesh_id
        state = cluster_state(server)  # the router replica finds its own mesh's controller and actors
        assert state.controller_alive and state.replicas and all(r.alive for r in state.replicas), mesh_id
    assert "controller" in actor_ids("alpha") and "controller" in actor_ids("beta")
    beta_before = actor_ids("beta")

    victim = "expert-e0-r0"
    kill_and_wait(victim, namespace=MeshNames.of("alpha").namespace)
    # Through the front over both, at once (alpha has not restored yet): beta's model answers as before.
    assert ask_front(front, model_of("beta", checkpoints)) == expected["beta"]

    def alpha_restored() -> bool:
        state = cluster_state(servers["alpha"])
        return any(r.actor == victim and r.alive for r in state.replicas) and state.controller_alive

    wait_for(alpha_restored, RESTORE_S, f"alpha to restore {victim}", every=0.5, ignore=(grpc.RpcError,))
    assert ask(servers["alpha"]) == expected["alpha"]
    assert ask_front(front, model_of("alpha", checkpoints)) == expected["alpha"]
    info = ray.get(ray.get_actor(victim, namespace="expertmesh-alpha").info.remote())
    assert info["generation"] == 1
    # Beta: the same actors and controller, all alive, the same answers.
    assert actor_ids("beta") == beta_before
    assert all(r.alive and not r.restoring for r in cluster_state(servers["beta"]).replicas)
    assert ask(servers["beta"]) == expected["beta"]


def test_a_drill_on_one_mesh_kills_only_that_meshs_actors(servers, expected, checkpoints, tmp_path):
    """`expertmesh drill --target --address --mesh-id beta` (an operator drilling one model of a shared cluster): the
    kills land in beta's namespace, beta restores them without a failed request, alpha's actors are untouched."""
    alpha_before = actor_ids("alpha")
    beta_before = actor_ids("beta")
    out = tmp_path / "drill"
    proc = subprocess.run(
        [sys.executable, "-m", "expertmesh.ops.cli", "drill", "--target", servers["beta"].target,
         "--address", ray.get_runtime_context().gcs_address, "--mesh-id", "beta",
         "--model", str(checkpoints[MODELS["beta"]]), "--kill", "actor", "--duration", "4", "--every", "4",
         "--baseline", "2", "--concurrency", "2", "--max-tokens", "4", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    (kill,) = report["kills"]
    assert kill["error"] is None and len(kill["targets"]) == 1 and kill["targets"][0] in beta_before, kill
    assert report["requests"]["failed"] == 0, report["requests"]["failed_by_code"]
    wait_for(lambda: all(r.alive and not r.restoring for r in cluster_state(servers["beta"]).replicas), RESTORE_S,
             "beta to restore the drilled actor", every=0.5, ignore=(grpc.RpcError,))
    assert actor_ids("beta")[kill["targets"][0]] != beta_before[kill["targets"][0]]  # killed and restored
    assert actor_ids("alpha") == alpha_before
    assert ask(servers["alpha"]) == expected["alpha"]
