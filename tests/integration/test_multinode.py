"""Placement on a multi-node cluster whose nodes declare GPUs (ray.cluster_utils.Cluster, no real GPU needed)."""

from __future__ import annotations

import pytest
import ray
import torch

from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from tests.clusters import FAKE_GPUS, start_cluster


@pytest.fixture(scope="module")
def gpu_cluster():
    cluster, workers = start_cluster({"num_cpus": 1, "num_gpus": 0, "include_dashboard": False},
                                     [{"num_cpus": 2, "num_gpus": 2}] * 2)
    ray.init(address=cluster.address)
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def test_actors_land_where_the_placement_says_and_hold_gpus(gpu_cluster, checkpoints):
    _, workers = gpu_cluster
    worker_ids = {w.node_id for w in workers}
    path = checkpoints["mixtral"]  # 4 experts x 2 replicas = 8 actors on 4 declared GPUs
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    want = load_reference_model(path).forward([torch.tensor(ids)])[0]
    with ExpertMesh(MeshConfig.from_dict({"model": {"path": str(path)},
                                          "experts": {"replicas_per_expert": 2, "layout": "per-expert"},
                                          "controller": {"enabled": False}, "devices": FAKE_GPUS})) as mesh:
        infos = {i["name"]: i for i in mesh.actor_info()}
        slots = {s.name: s for s in mesh.slots}
        got = mesh.score(ids)
    assert len(infos) == 8
    for name, info in infos.items():
        slot = slots[name]
        assert info["node_id"] == slot.node_id, name  # pinned where the plan put it
        assert slot.node_id in worker_ids  # never on the GPU-less head
        assert slot.num_gpus == 0.5 and len(info["gpu_ids"]) == 1  # two actors share each GPU
    # Two actors per (node, GPU id): Ray's packing realised the plan's fractions.
    per_gpu: dict[tuple[str, str], int] = {}
    for info in infos.values():
        key = (info["node_id"], info["gpu_ids"][0])
        per_gpu[key] = per_gpu.get(key, 0) + 1
    assert sorted(per_gpu.values()) == [2, 2, 2, 2]
    # Replicas of one expert sit on different nodes, so losing a node leaves one.
    for expert in range(4):
        assert infos[f"expert-e{expert}-r0"]["node_id"] != infos[f"expert-e{expert}-r1"]["node_id"]
    assert (got - want).abs().max().item() <= 1e-4
