"""The elastic control step (cluster/elastic.py), pure: devices from nodes, the running placement, and the decision
to rebalance or autoscale, with the imbalance before and after. No Ray."""

from __future__ import annotations

import numpy as np
import pytest

from expertmesh.cluster.actor_slots import NodeResources
from expertmesh.cluster.elastic import (
    ElasticConfig,
    ElasticState,
    actor_slots,
    cluster_devices,
    control_step,
    current_placement,
)
from expertmesh.cluster.placement_actors import actor_plans, actor_shards
from expertmesh.cluster.shard_placement import Placement, Topology

LAYER_IDS = [0, 1, 2, 3]  # model layer ids of the MoE layers
EXPERTS = 8


def zipf_load(layers: int = 4, experts: int = EXPERTS, tokens: float = 4096, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(layers):
        weights = 1.0 / np.arange(1, experts + 1) ** 1.1
        rows.append(rng.permutation(weights / weights.sum()) * tokens)
    return np.array(rows)


def running_of(placement: Placement) -> dict[str, list[tuple[int, int]]]:
    return actor_shards(placement, LAYER_IDS)


def test_devices_are_gpus_in_node_order_or_nodes_without_gpus():
    nodes = [NodeResources("b", 8, 2), NodeResources("a", 8, 1), NodeResources("head", 4, 0)]
    devices = cluster_devices(nodes, slots_per_gpu=3)
    assert devices.node_ids == ["a", "b"] and devices.has_gpus
    assert devices.topology == Topology(2, 2, 3, frozenset({1}))  # node a has no second GPU
    cpu = cluster_devices([NodeResources("y", 2), NodeResources("x", 2)], slots_per_gpu=4)
    assert cpu.node_ids == ["x", "y"] and not cpu.has_gpus and cpu.topology == Topology(2, 1, 4)


def test_actor_slots_give_gpu_fractions_and_cpu_shares():
    devices = cluster_devices([NodeResources("n0", 4, 2), NodeResources("n1", 4, 2)], slots_per_gpu=2)
    placement = Placement.round_robin(devices.topology, 4, EXPERTS)
    slots = actor_slots(actor_plans(placement, LAYER_IDS), devices, ElasticConfig())
    assert sorted(slots) == ["expert-g0-v0", "expert-g1-v0", "expert-g2-v0", "expert-g3-v0"]
    g3 = slots["expert-g3-v0"]
    assert (g3.node_id, g3.gpu_slot, g3.num_gpus, g3.num_cpus) == ("n1", 1, 0.5, 1.0)
    cpu = cluster_devices([NodeResources("c", 1)], slots_per_gpu=8)
    only = actor_slots(actor_plans(Placement.round_robin(cpu.topology, 4, EXPERTS), LAYER_IDS), cpu,
                       ElasticConfig(num_cpus_per_actor=0.25))
    assert [(s.num_gpus, s.num_cpus, s.gpu_slot) for s in only.values()] == [(0.0, 0.25, None)]


def test_current_placement_merges_actors_on_one_device_and_refuses_overflow():
    devices = cluster_devices([NodeResources("n", 4, 2)], slots_per_gpu=4)
    running = {f"expert-e{e}-r0": [(layer, e) for layer in LAYER_IDS] for e in range(EXPERTS)}
    device = {f"expert-e{e}-r0": e % 2 for e in range(EXPERTS)}
    placement = current_placement(running, device, devices, LAYER_IDS, EXPERTS)
    assert placement.gpu_shards(0)[:4] == [(0, 0), (0, 2), (0, 4), (0, 6)]
    small = cluster_devices([NodeResources("n", 4, 2)], slots_per_gpu=3)
    with pytest.raises(ValueError, match="slots_per_gpu"):
        current_placement(running, device, small, LAYER_IDS, EXPERTS)


def test_skewed_load_rebalances_below_target_then_holds_still():
    topology = Topology(2, 2, 3)  # 4 GPUs, 3 slots each per layer: 8 experts + up to 4 extra replicas per layer
    start = Placement.round_robin(topology, 4, EXPERTS)
    load = zipf_load()
    config = ElasticConfig(extra_replica_fraction=0.25)
    outcome, state = control_step(0.0, load, start, running_of(start), LAYER_IDS, ElasticState(), config)
    assert outcome.reason == "rebalance" and max(outcome.imbalance_before) > 1.15
    assert max(outcome.imbalance_after) <= 1.15
    assert outcome.replicas_after <= outcome.replicas_before * 1.25  # at most 25 % extra replicas
    step = outcome.transition
    assert step.start and set(step.drain) <= set(running_of(start))
    # Under the new placement, the same load is balanced: the next interval does nothing (no flapping) ...
    again, state = control_step(10.0, load, outcome.placement, step.actors, LAYER_IDS, state, config)
    assert again.reason == "balanced" and again.transition is None
    # ... and so does a little noise on the load.
    noisy = load * np.random.default_rng(1).uniform(0.97, 1.03, load.shape)
    calm, _ = control_step(20.0, noisy, outcome.placement, step.actors, LAYER_IDS, state, config)
    assert calm.transition is None


def test_little_load_does_nothing():
    topology = Topology(1, 2, 4)
    start = Placement.round_robin(topology, 4, EXPERTS)
    load = zipf_load(tokens=10)
    outcome, _ = control_step(0.0, load, start, running_of(start), LAYER_IDS, ElasticState(), ElasticConfig())
    assert outcome.reason == "little load" and outcome.transition is None


def test_autoscale_without_room_asks_for_gpus_then_places_when_they_join():
    config = ElasticConfig(slots_per_gpu=4, autoscale={"target_load_per_replica": 300.0, "max_gpus": 4,
                                                       "base_gpus": 2, "downscale_delay_s": 30.0})
    full = Placement.round_robin(Topology(1, 2, 4), 4, EXPERTS)  # 2 GPUs x 4 slots: every slot used
    load = zipf_load(tokens=4096)  # the hottest experts carry ~1200 per layer: > 300 x 1.2 per replica
    outcome, state = control_step(0.0, load, full, running_of(full), LAYER_IDS, ElasticState(), config)
    assert outcome.request_gpus and outcome.request_gpus > 2
    assert outcome.replicas_after in (0, outcome.replicas_before)  # no room: at most a swap between the 2 GPUs

    # Two more GPUs joined (a second node): the same policy now places replicas there.
    grown = Topology(2, 2, 4)
    slots = np.full((4, 4, 4), -1)
    slots[:, :2] = full.slots
    current = Placement(grown, EXPERTS, slots)
    outcome, state = control_step(10.0, load, current, running_of(current), LAYER_IDS, state, config)
    assert outcome.reason == "autoscale" and outcome.transition is not None
    assert outcome.replicas_after > outcome.replicas_before
    assert any(plan.node == 1 for plan in outcome.transition.start.values())
    assert max(outcome.imbalance_after) < max(outcome.imbalance_before)

    # Load goes away: after the cooldown the replicas go and the GPU request is released.
    quiet = np.full_like(load, 1.0)
    placed = outcome.placement
    running = outcome.transition.actors
    out1, state = control_step(20.0, quiet, placed, running, LAYER_IDS, state, config)
    assert out1.transition is None  # cold, but not for long enough yet
    out2, state = control_step(60.0, quiet, placed, running, LAYER_IDS, state, config)
    assert out2.reason == "autoscale" and out2.replicas_after < placed.total_replicas()
    assert out2.request_gpus == 0


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="slots_per_gpu"):
        ElasticConfig(slots_per_gpu=0).validate()
    with pytest.raises(ValueError, match="rebalance_threshold"):
        ElasticConfig(rebalance_threshold=0.5).validate()
    with pytest.raises(ValueError, match="autoscale"):
        ElasticConfig(autoscale={"bogus": 1}).validate()
    with pytest.raises(ValueError, match="target_load_per_replica"):
        ElasticConfig(autoscale={"target_load_per_replica": 0, "max_gpus": 2, "base_gpus": 1}).validate()


def test_planned_layout_checks_slots_and_the_placement_against_the_cluster():
    from expertmesh.experts.checkpoint import CheckpointReader
    from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
    from expertmesh.router_service.errors import RequestError
    from expertmesh.router_service.pool_layout import planned_layout

    cfg = CheckpointReader(EMBEDDED_MODEL_DIR).config  # the embedded model: 4 MoE layers x 8 experts
    nodes = [NodeResources("n0", 4, 1), NodeResources("n1", 4, 1)]
    with pytest.raises(RequestError, match="slots_per_gpu.*give at least 4"):
        planned_layout(cfg, nodes, ElasticConfig(slots_per_gpu=3))
    groups, slots = planned_layout(cfg, nodes, ElasticConfig(slots_per_gpu=5))
    assert sorted(groups) == ["expert-g0-v0", "expert-g1-v0"] and sum(len(s) for s in groups.values()) == 32
    assert {(s.node_id, s.num_gpus) for s in slots} == {("n0", 0.5), ("n1", 0.5)}
    other = Placement.round_robin(Topology(1, 2, 5), 4, EXPERTS)  # planned for 1 node x 2 GPUs
    with pytest.raises(RequestError, match="placement"):
        planned_layout(cfg, nodes, ElasticConfig(), other)
