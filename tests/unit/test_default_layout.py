"""The default expert pool (cluster/default_pool.py, pure; router_service/pool_layout.py feeds it the live nodes): one
actor per logical expert up to MANY_EXPERTS experts per layer (names expert-e{E}-r{R}, which drills and tests rely
on), beyond that one actor per device (GPU, or node without GPUs) hosting a contiguous slice of every layer's
experts."""

from __future__ import annotations

import pytest

from expertmesh.cluster.actor_slots import NodeResources
from expertmesh.cluster.default_pool import (
    MANY_EXPERTS,
    cluster_device_count,
    default_actor_groups,
    device_actor_groups,
    device_actor_slots,
    expert_slices,
)
from expertmesh.experts.config import MoEModelConfig
from expertmesh.router_service import pool_layout


def _cfg(experts: int, layers: int = 3) -> MoEModelConfig:
    return MoEModelConfig(family="qwen2_moe", vocab_size=64, hidden_size=16, num_layers=layers, num_heads=2,
                          num_kv_heads=1, head_dim=8, num_experts=experts, top_k=2, expert_intermediate_size=8,
                          norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
                          moe_layers=tuple(range(layers)))


def _covered(groups) -> dict:
    replicas: dict = {}
    for name, shards in groups.items():
        for shard in shards:
            replicas.setdefault(shard, []).append(name)
    return replicas


@pytest.mark.parametrize("devices", [None, 1, 4, 64])
def test_eight_experts_keep_one_actor_per_expert(devices):
    groups = default_actor_groups(_cfg(8), 2, devices)
    assert list(groups) == [f"expert-e{e}-r{r}" for e in range(8) for r in range(2)]
    assert groups["expert-e3-r1"] == [(layer, 3) for layer in range(3)]


def test_many_experts_get_one_actor_per_device_with_a_slice_of_every_layer():
    cfg = _cfg(128)
    groups = default_actor_groups(cfg, 1, devices=4)
    assert list(groups) == [f"expert-e{g}-r0" for g in range(4)]
    assert groups["expert-e1-r0"] == [(layer, e) for layer in range(3) for e in range(32, 64)]
    replicas = _covered(groups)
    assert sorted(replicas) == [(layer, e) for layer in range(3) for e in range(128)]
    assert all(len(r) == 1 for r in replicas.values())


def test_many_experts_with_replicas_and_more_devices_than_experts():
    groups = default_actor_groups(_cfg(MANY_EXPERTS + 4), 2, devices=3)
    assert list(groups) == [f"expert-e{g}-r{r}" for g in range(3) for r in range(2)]
    assert all(len(r) == 2 for r in _covered(groups).values())
    assert [len(s) for s in expert_slices(20, 3)] == [7, 6, 7]
    assert expert_slices(20, 64) == [[e] for e in range(20)]  # never an empty actor


def test_devices_are_gpus_or_else_nodes():
    assert cluster_device_count([NodeResources("a", 8, 2), NodeResources("b", 8, 4), NodeResources("c", 4)]) == 6
    assert cluster_device_count([NodeResources("a", 8), NodeResources("b", 2)]) == 2


def test_device_actors_take_their_nodes_cores_but_one():
    nodes = [NodeResources("n1", 8.0), NodeResources("n0", 6.0)]
    slots = device_actor_slots(["expert-e0-r0", "expert-e1-r0"], nodes, None)
    assert {(s.node_id, s.num_cpus, s.num_gpus) for s in slots} == {("n0", 5.0, 0.0), ("n1", 7.0, 0.0)}
    # two replicas of each slice: on different nodes, each node's cores (but one) shared by its two actors
    slots = device_actor_slots([f"expert-e{g}-r{r}" for g in range(2) for r in range(2)], nodes, None)
    assert slots[0].node_id != slots[1].node_id and slots[2].node_id != slots[3].node_id
    assert sorted(s.num_cpus for s in slots) == [2.5, 2.5, 3.5, 3.5]
    assert {s.num_cpus for s in device_actor_slots(["expert-e0-r0"], nodes, 1.5)} == {1.5}  # given: as given


def test_device_actors_on_gpus_get_one_gpu_each():
    nodes = [NodeResources("a", 16.0, 2), NodeResources("b", 16.0, 2)]
    slots = device_actor_slots([f"expert-e{g}-r0" for g in range(4)], nodes, None)
    assert sorted((s.node_id, s.gpu_slot) for s in slots) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert {(s.num_gpus, s.num_cpus) for s in slots} == {(1.0, 7.5)}


def test_pool_layout_switches_at_many_experts(monkeypatch):
    monkeypatch.setattr(pool_layout, "cluster_nodes", lambda: [NodeResources("n0", 16.0)])
    groups, slots = pool_layout.pool_layout(_cfg(8), 1, None, None, None)
    assert slots is None and len(groups) == 8
    monkeypatch.setattr(pool_layout, "cluster_nodes", lambda: [NodeResources("n0", 2.0)])
    groups, slots = pool_layout.pool_layout(_cfg(256), 1, None, None, None)
    assert list(groups) == ["expert-e0-r0"] and len(groups["expert-e0-r0"]) == 3 * 256
    assert [(s.name, s.node_id, s.num_cpus) for s in slots] == [("expert-e0-r0", "n0", 1.0)]


def test_auto_layout_gives_each_per_expert_actor_a_core_or_gpu_or_goes_per_device():
    eight = _cfg(8)
    assert pool_layout.default_layout(eight, 1, [NodeResources("n", 9.0)]) == "per-expert"  # 8 actors + router
    assert pool_layout.default_layout(eight, 1, [NodeResources("n", 8.0)]) == "per-device"
    assert pool_layout.default_layout(eight, 2, [NodeResources("a", 9.0), NodeResources("b", 8.0)]) == "per-expert"
    assert pool_layout.default_layout(eight, 1, [NodeResources("n", 64.0, 8)]) == "per-expert"  # a GPU each
    assert pool_layout.default_layout(eight, 1, [NodeResources("n", 64.0, 4)]) == "per-device"
    assert pool_layout.default_layout(_cfg(MANY_EXPERTS + 1), 1, [NodeResources("n", 512.0)]) == "per-device"
    for explicit in ("per-expert", "per-device"):  # asked for: as asked, whatever the cluster
        assert pool_layout.default_layout(eight, 1, [NodeResources("n", 2.0)], explicit) == explicit
        assert pool_layout.default_layout(eight, 1, [NodeResources("n", 512.0)], explicit) == explicit


def test_small_machine_gets_one_actor_hosting_every_expert_unless_per_expert_is_asked(monkeypatch):
    monkeypatch.setattr(pool_layout, "cluster_nodes", lambda: [NodeResources("n0", 2.0)])
    groups, slots = pool_layout.pool_layout(_cfg(8), 2, None, None, None)
    assert list(groups) == ["expert-e0-r0", "expert-e0-r1"]  # replicas of the one slice: failover still has a spare
    assert all(shards == [(layer, e) for layer in range(3) for e in range(8)] for shards in groups.values())
    assert [(s.name, s.node_id) for s in slots] == [("expert-e0-r0", "n0"), ("expert-e0-r1", "n0")]
    groups, slots = pool_layout.pool_layout(_cfg(8), 1, None, None, None, "per-expert")
    assert slots is None and list(groups) == [f"expert-e{e}-r0" for e in range(8)]


def test_device_actor_groups_slice_any_expert_count():
    groups = device_actor_groups(_cfg(8), 1, devices=3)
    assert list(groups) == ["expert-e0-r0", "expert-e1-r0", "expert-e2-r0"]
    assert sorted(_covered(groups)) == [(layer, e) for layer in range(3) for e in range(8)]


def test_the_old_homes_still_give_the_layout_helpers():
    # expert_pool.py (a Ray module) and pool_layout.py re-export what moved to cluster/default_pool.py
    from expertmesh.cluster import default_pool
    from expertmesh.router_service import expert_pool

    for name in ("MANY_EXPERTS", "cluster_device_count", "default_actor_groups", "device_actor_groups",
                 "device_actor_slots", "expert_slices"):
        assert getattr(expert_pool, name) is getattr(default_pool, name)
    assert pool_layout.default_layout is default_pool.default_layout
