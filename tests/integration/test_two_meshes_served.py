"""Two `expertmesh serve` processes on one Ray cluster with different mesh ids (--mesh-id alpha / beta) serving
two models: each Serve application, controller and pool is its own mesh's, each answers exactly like its reference,
and killing an expert actor of one (by name, in its namespace, from this driver) leaves the other's actors and
answers alone while the first restores it."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
import ray

from expertmesh.cluster.naming import MeshNames
from expertmesh.experts.reference import load_reference_model
from expertmesh.protos import admin_pb2, admin_pb2_grpc
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


def test_two_served_meshes_kill_in_one(servers, expected):
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

    def alpha_restored() -> bool:
        state = cluster_state(servers["alpha"])
        return any(r.actor == victim and r.alive for r in state.replicas) and state.controller_alive

    wait_for(alpha_restored, RESTORE_S, f"alpha to restore {victim}", every=0.5, ignore=(grpc.RpcError,))
    assert ask(servers["alpha"]) == expected["alpha"]
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
