"""A router that asks for a GPU on one 8-GPU node (a `ray.cluster_utils.Cluster` node declaring 8 GPUs, no real
ones): the expert pool leaves the router replicas' GPUs whole, Serve places the replicas on them, requests are
answered, and no GPU is double-booked. Also: an expert actor or router replica Ray gives a GPU that torch cannot see
refuses to start with one line unless devices.gpu_without_cuda is cpu (README: Data types and devices).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict

import grpc
import pytest
import ray

from expertmesh.cluster.naming import NAMESPACE, is_expert_actor_name
from expertmesh.experts.errors import ConfigError
from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.config import MeshConfig
from expertmesh.router_service.mesh import ExpertMesh
from tests.clusters import FAKE_GPU_FLAGS, FAKE_GPUS, cluster_with_gpus
from tests.served import generate_ids, router_replicas, start_server
from tests.tiny_checkpoints import greedy_tokens

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
MAX_TOKENS = 4
GPUS = 8


@pytest.fixture(scope="module")
def node8():
    """A CPU-only head and one worker declaring 8 GPUs (4 CPUs: one kept per GPU router replica)."""
    with cluster_with_gpus(GPUS, cpus_per_node=4) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def expected(checkpoints) -> list[int]:
    return greedy_tokens(load_reference_model(checkpoints["mixtral"]), PROMPT, MAX_TOKENS)


def _where(handle) -> dict:
    """node, GPU ids and GPU share Ray assigned the actor behind `handle` (asked inside that actor's process)."""
    def assigned(_self) -> dict:
        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "gpu": ctx.get_assigned_resources().get("GPU", 0.0)}

    return ray.get(handle.__ray_call__.remote(assigned), timeout=60)


def _expert_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if is_expert_actor_name(a["name"])]


def check_placement(routers: int) -> None:
    """Every router replica holds a whole GPU with nothing else on it; no GPU carries more than 1 in shares."""
    experts = {name: _where(ray.get_actor(name, namespace=NAMESPACE)) for name in _expert_actors()}
    replicas = {name: _where(ray.get_actor(name, namespace=ns)) for name, ns in router_replicas()}
    assert len(replicas) == routers and experts, (replicas, experts)
    per_gpu: dict[tuple[str, str], float] = {}
    for where in [*experts.values(), *replicas.values()]:
        assert len(where["gpu_ids"]) == 1, where  # everyone here asked for one GPU or a share of one
        key = (where["node"], where["gpu_ids"][0])
        per_gpu[key] = per_gpu.get(key, 0.0) + where["gpu"] / len(where["gpu_ids"])
    assert all(total <= 1.0 + 1e-9 for total in per_gpu.values()), per_gpu
    router_gpus = {(w["node"], w["gpu_ids"][0]) for w in replicas.values()}
    expert_gpus = {(w["node"], w["gpu_ids"][0]) for w in experts.values()}
    assert len(router_gpus) == routers and all(w["gpu"] == 1.0 for w in replicas.values())
    assert not router_gpus & expert_gpus, (router_gpus, expert_gpus)  # no expert on a router's GPU


def test_an_actor_given_a_gpu_torch_cannot_see_refuses_in_one_line_unless_told_cpu(node8, checkpoints):
    config = MeshConfig.from_dict({"model": {"path": str(checkpoints["mixtral"])}, "ray": {"address": node8.address},
                                   "experts": {"layout": "per-expert"}, "controller": {"enabled": False}})
    with pytest.raises(ConfigError) as err:
        ExpertMesh(config)
    assert err.value.field == "devices.gpu_without_cuda" and "\n" not in str(err.value)
    assert err.value.message.startswith("expert actor expert-e"), err.value.message
    assert "by Ray, but torch sees no CUDA" in err.value.message and "--gpu-without-cuda cpu" in err.value.message
    assert _expert_actors() == []  # the pool stopped what it started
    with ExpertMesh(config.replace(**{"devices.gpu_without_cuda": "cpu"})) as mesh:
        infos = mesh.actor_info()
        assert all(i["gpu_ids"] and i["device"] == "cpu" for i in infos)  # given a GPU, computing on the CPU
        assert mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids == greedy_tokens(
            load_reference_model(checkpoints["mixtral"]), PROMPT, MAX_TOKENS)


def test_serve_refusing_exits_with_the_line(node8, checkpoints):
    refused = subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", "serve", "--port", "0", "--address",
                              node8.address, "--model", str(checkpoints["mixtral"]), "--router-gpus", "1"],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("error: devices.gpu_without_cuda: expert actor expert-e"), refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert _expert_actors() == []


# Two replicas, not also one: each must hold a GPU of its own beside the experts' (the one-replica run this replaced
# checked a subset of that, for 45 s of CI).
@pytest.mark.parametrize("routers", [2])
def test_serve_with_router_gpus_on_one_eight_gpu_node(node8, checkpoints, expected, routers):
    server = start_server(*FAKE_GPU_FLAGS, "--address", node8.address, "--model", str(checkpoints["mixtral"]),
                          "--router-gpus", "1", "--router-replicas", str(routers))
    try:
        with grpc.insecure_channel(server.target) as chan:
            for _ in range(2 * routers):  # Serve spreads requests over the replicas
                assert generate_ids(chan, PROMPT, MAX_TOKENS) == expected
        check_placement(routers)
    finally:
        assert server.stop() == 0, server.log()


def test_a_router_replica_refuses_through_serve_with_its_line(node8, checkpoints):
    from ray import serve

    from expertmesh.router_service.deployment import RouterDeployment, router_options
    from expertmesh.router_service.server import router_refusal
    from expertmesh.router_service.startup import start_mesh

    tree = {"model": {"path": str(checkpoints["mixtral"])}, "ray": {"address": node8.address},
            "experts": {"layout": "per-expert"}, "controller": {"enabled": False}, "router": {"gpus": 1}}
    runtime = start_mesh(MeshConfig.from_dict({**tree, "devices": FAKE_GPUS}))  # experts told cpu ...
    refusing = MeshConfig.from_dict(tree)  # ... the router replica is not
    try:
        serve.start(proxy_location="Disabled")
        with pytest.raises(Exception) as err:  # noqa: PT011 - Serve's own deployment failure
            serve.run(RouterDeployment.options(**router_options(refusing)).bind(refusing.to_dict(),
                                                                                asdict(runtime.spec)),
                      name="refusal", route_prefix=None, blocking=False)
        line = router_refusal(err.value, "refusal")  # what `expertmesh serve` prints as its error line
        assert line is not None and line.startswith("router replica was given GPU "), str(err.value)[-2000:]
        assert "torch sees no CUDA" in line and "--gpu-without-cuda cpu" in line
    finally:
        serve.shutdown()
        runtime.stop(keep_ray=True)
