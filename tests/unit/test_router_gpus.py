"""The GPUs kept for router replicas (`expertmesh.cluster.router_gpus`) and what the expert pool plans onto around
them: how many whole GPUs, on which nodes, and that Ray's packing of the pool's fractions leaves them whole."""

from __future__ import annotations

import pytest

from expertmesh.cluster.actor_slots import NodeResources, plan_actor_slots
from expertmesh.cluster.naming import expert_actor_name
from expertmesh.cluster.router_gpus import (
    NO_RESERVATION,
    RouterReservation,
    expert_nodes,
    replicas_at_start,
    replicas_per_gpu,
    reservation_problem,
    reserve_router_gpus,
    router_gpu_count,
    router_units,
)

# The shipped cluster shapes (cluster/configs): a CPU head, a 1-GPU router node, two 4-GPU expert nodes.
AWS = [NodeResources("head", 4.0), NodeResources("router-g6e-xl", 4.0, 1),
       NodeResources("experts-a", 48.0, 4), NodeResources("experts-b", 48.0, 4)]
GCP = [NodeResources("head", 4.0), NodeResources("router-g2-12", 12.0, 1),
       NodeResources("experts-a", 48.0, 4), NodeResources("experts-b", 48.0, 4)]
ONE_NODE = [NodeResources("n8", 16.0, 8)]


def best_fit_gpu_ids(slots, gpus_per_node: dict[str, int]) -> dict[str, tuple[str, int]]:
    """Where Ray puts each slot's GPU share: its node's GPU with the least room that still fits (Ray's allocation
    of a fractional GPU request, ties to the lowest id); a whole-GPU request takes only empty GPUs."""
    free = {node: [1.0] * n for node, n in gpus_per_node.items()}
    where = {}
    for slot in slots:
        gpus = free[slot.node_id]
        fits = [i for i, room in enumerate(gpus) if room + 1e-9 >= slot.num_gpus]
        if slot.num_gpus >= 1:
            fits = [i for i in fits if gpus[i] == 1.0]
        i = min(fits, key=lambda i: (gpus[i] - slot.num_gpus, i))
        gpus[i] -= slot.num_gpus
        where[slot.name] = (slot.node_id, i)
    return where


def test_replicas_at_start_are_the_fixed_count_or_the_autoscale_minimum():
    assert replicas_at_start(2, None) == 2
    assert replicas_at_start(1, (1, 4)) == 1  # extra replicas ask the autoscaler; nothing is kept for them
    assert replicas_at_start(1, (3, 4)) == 3


@pytest.mark.parametrize(("gpus", "replicas", "kept"), [
    (0.0, 3, 0),  # routers on the CPU keep nothing
    (1.0, 0, 0),
    (1.0, 1, 1),
    (1.0, 2, 2),
    (2.0, 2, 4),  # whole GPUs per replica
    (0.5, 2, 1),  # two halves share one GPU
    (0.5, 3, 2),
    (0.4, 5, 3),  # 2 to a GPU: 3 GPUs, not ceil(0.4 x 5) = 2 (Ray never splits one replica's share)
    (0.3, 4, 2),
    (0.2, 5, 1),  # 1 / 0.2 is 4.999... in floats: still 5 to a GPU
    (0.7, 3, 3),
])
def test_whole_gpus_kept(gpus, replicas, kept):
    assert router_gpu_count(gpus, replicas) == kept


def test_units_and_replicas_per_gpu():
    assert replicas_per_gpu(0.25) == 4 and replicas_per_gpu(1.0) == 1 and replicas_per_gpu(3.0) == 1
    assert router_units(0.4, 5) == [(1, 2), (1, 2), (1, 1)]
    assert router_units(2.0, 2) == [(2, 1), (2, 1)]


def test_one_eight_gpu_node_keeps_the_router_gpu_and_gives_the_rest_to_the_experts():
    reservation = reserve_router_gpus(ONE_NODE, 1.0, 1, cpus_per_replica=1.0)
    assert reservation.gpus == {"n8": 1} and reservation.cpus == {"n8": 1.0} and reservation.unplaced == 0
    assert expert_nodes(ONE_NODE, reservation) == [NodeResources("n8", 15.0, 7)]
    assert reservation_problem(ONE_NODE, reservation) is None
    two = reserve_router_gpus(ONE_NODE, 1.0, 2, cpus_per_replica=1.0)
    assert two.gpus == {"n8": 2} and expert_nodes(ONE_NODE, two) == [NodeResources("n8", 14.0, 6)]


@pytest.mark.parametrize("shape", [AWS, GCP], ids=["aws-gpu.yaml", "gcp-gpu.yaml"])
def test_the_cloud_shapes_keep_the_router_node_and_the_experts_get_the_expert_nodes(shape):
    reservation = reserve_router_gpus(shape, 1.0, 1, cpus_per_replica=1.0)
    router_node = shape[1].node_id
    assert reservation.gpus == {router_node: 1}  # best fit: the smallest GPU node
    view = {n.node_id: n.num_gpus for n in expert_nodes(shape, reservation)}
    assert view == {"head": 0, router_node: 0, "experts-a": 4, "experts-b": 4}
    names = [expert_actor_name(e, r) for e in range(8) for r in range(2)]
    slots = plan_actor_slots(names, expert_nodes(shape, reservation))
    assert {s.node_id for s in slots} == {"experts-a", "experts-b"}  # no expert on the router node
    # A second router replica at start finds no second router node: it keeps a GPU of an expert node.
    two = reserve_router_gpus(shape, 1.0, 2, cpus_per_replica=1.0)
    assert two.gpus == {router_node: 1, "experts-a": 1}


def test_pool_fractions_packed_by_ray_never_touch_the_kept_gpus():
    nodes = [NodeResources("a", 8.0, 8)]
    for replicas in (1, 2, 3):
        reservation = reserve_router_gpus(nodes, 1.0, replicas, cpus_per_replica=1.0)
        view = expert_nodes(nodes, reservation)
        for actors in (3, 7, 8, 13, 16, 21):
            names = [f"x{i}" for i in range(actors)]
            slots = plan_actor_slots(names, view)
            assert all(s.gpu_slot < 8 - replicas for s in slots)
            assert sum(s.num_cpus for s in slots) <= 8.0 - replicas + 1e-9  # the routers' CPUs stay free
            used = {gpu for _, gpu in best_fit_gpu_ids(slots, {"a": 8}).values()}
            assert len(used) <= 8 - replicas, (replicas, actors, used)  # the kept GPUs stay whole


def test_fractional_routers_pack_onto_kept_gpus():
    nodes = [NodeResources("a", 8.0, 4), NodeResources("b", 8.0, 4)]
    reservation = reserve_router_gpus(nodes, 0.5, 3, cpus_per_replica=1.0)
    assert reservation.gpus == {"a": 2} and reservation.cpus == {"a": 3.0}  # 2 + 1 replicas, packed on one node
    assert [n.num_gpus for n in expert_nodes(nodes, reservation)] == [2, 4]


def test_a_reservation_sticks_to_the_nodes_it_used():
    nodes = [NodeResources("big", 8.0, 8)]
    first = reserve_router_gpus(nodes, 1.0, 1)
    grown = nodes + [NodeResources("a-small", 4.0, 1)]  # the autoscaler added a smaller node
    assert reserve_router_gpus(grown, 1.0, 1).gpus == {"a-small": 1}
    assert reserve_router_gpus(grown, 1.0, 1, prefer=first.gpus).gpus == {"big": 1}


def test_replicas_that_cannot_place_are_reported_in_one_line():
    two_gpu_replica = reserve_router_gpus([NodeResources("a", 4.0, 1), NodeResources("b", 4.0, 1)], 2.0, 1)
    assert two_gpu_replica.unplaced == 1 and two_gpu_replica.gpus == {}
    line = reservation_problem([NodeResources("a", 4.0, 1)], two_gpu_replica)
    assert "router.gpus 2 x 1 replica at start: 1 router replica cannot be placed" in line and "\n" not in line
    cpu_only = reserve_router_gpus([NodeResources("a", 4.0)], 1.0, 1)
    assert cpu_only.unplaced == 1 and "the cluster has no GPU" in reservation_problem([NodeResources("a", 4.0)],
                                                                                      cpu_only)
    no_cpu = reserve_router_gpus([NodeResources("a", 0.5, 2)], 1.0, 1, cpus_per_replica=1.0)
    assert no_cpu.unplaced == 1


def test_keeping_every_gpu_for_routers_is_refused():
    nodes = [NodeResources("a", 8.0, 1)]
    reservation = reserve_router_gpus(nodes, 1.0, 1)
    assert reservation.gpus == {"a": 1}
    assert "leaves none for the expert actors" in reservation_problem(nodes, reservation)


def test_cpu_routers_keep_nothing_and_the_reservation_round_trips():
    assert reserve_router_gpus(ONE_NODE, 0.0, 2, cpus_per_replica=1.0) == RouterReservation(0.0, 0)
    assert expert_nodes(ONE_NODE, NO_RESERVATION) == ONE_NODE
    reservation = reserve_router_gpus(AWS, 1.0, 2, cpus_per_replica=1.0)
    assert RouterReservation.from_dict(reservation.as_dict()) == reservation
    assert RouterReservation.from_dict(None) == NO_RESERVATION
    assert reservation.describe().startswith("2 GPUs kept for 2 router replicas x 1 GPU")
