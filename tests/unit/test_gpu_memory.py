"""The pool's memory check on GPUs: bytes per GPU from the slots, overfull GPUs, GPUs needed by bytes."""

from __future__ import annotations

import pytest

from expertmesh.cluster.actor_slots import NodeResources, plan_actor_slots
from expertmesh.cluster.gpu_memory import (
    actor_bytes_of,
    gpu_loads,
    gpus_needed,
    min_distinct_gpus,
    overfull_gpus,
    shortfall_line,
    usable_bytes,
)
from expertmesh.cluster.memory_plan import GIB, RUNTIME_RESERVE_BYTES

GPU = 24 * GIB


def _slots(actors: int, gpus: int):
    names = [f"expert-e{i}-r0" for i in range(actors)]
    return names, plan_actor_slots(names, [NodeResources("n1", 16, gpus)], num_cpus_per_actor=1)


def test_fractions_that_fit_by_count_can_overfill_by_bytes():
    names, slots = _slots(4, 2)  # two 0.5-GPU actors per GPU: Ray would start them
    assert {s.num_gpus for s in slots} == {0.5}
    sizes = {n: 12 * GIB for n in names}  # 24 GiB per GPU of 24: over 0.9 x 24 - reserve
    loads = gpu_loads(slots, sizes)
    assert loads == {("n1", 0): 24 * GIB, ("n1", 1): 24 * GIB}
    over = overfull_gpus(slots, sizes, {"n1": GPU}, 0.9)
    assert [key for key, _, _ in over] == [("n1", 0), ("n1", 1)]
    assert over[0][2] == usable_bytes(GPU, 0.9) == int(GPU * 0.9) - RUNTIME_RESERVE_BYTES
    assert not overfull_gpus(slots, {n: 9 * GIB for n in names}, {"n1": GPU}, 0.9)
    assert not overfull_gpus(slots, sizes, {}, 0.9)  # unknown memory: not judged here


def test_gpus_needed_packs_by_bytes_and_respects_replicas():
    assert gpus_needed({"a": 12 * GIB, "b": 12 * GIB, "c": 6 * GIB, "d": 6 * GIB}, GPU, 0.9) == 2
    assert gpus_needed({"a": 1 * GIB}, GPU, 0.9, min_gpus=3) == 3
    with pytest.raises(ValueError, match="one expert actor needs 30.0 GiB"):
        gpus_needed({"a": 30 * GIB}, GPU, 0.9)


def test_bytes_per_actor_replicas_and_the_line():
    groups = {"expert-e0-r0": [(0, 0), (1, 0)], "expert-e0-r1": [(0, 0), (1, 0)], "expert-e1-r0": [(0, 1), (1, 1)]}
    assert actor_bytes_of(groups, 100) == {"expert-e0-r0": 200, "expert-e0-r1": 200, "expert-e1-r0": 200}
    assert min_distinct_gpus(groups) == 2
    line = shortfall_line(4, 2, GPU, [(("n1abcdefghijklmn", 0), 24 * GIB, 19 * GIB)])
    assert line.startswith("the expert actors need 4 GPUs of 24 GiB by memory, the cluster has 2: 2 missing")
    assert "GPU 0 of node n1abcdefghij would hold 24.0 GiB of 19.0 usable" in line
    kept = shortfall_line(8, 7, GPU, [], kept_for_routers=1)  # the router's GPU is not the experts' to count
    assert kept == ("the expert actors need 8 GPUs of 24 GiB by memory, the cluster has 7 besides the 1 kept for "
                    "router replicas: 1 missing")


def test_transition_room_needs_one_gpu_that_can_load_the_largest_actor_beside_its_own():
    from expertmesh.cluster.gpu_memory import transition_room

    names, slots = _slots(4, 2)  # 2 actors per GPU
    usable = usable_bytes(GPU, 0.9)
    assert transition_room(slots, {n: usable // 3 for n in names}, {"n1": GPU}, 0.9)  # 2/3 used: room for a third
    assert not transition_room(slots, {n: usable // 2 for n in names}, {"n1": GPU}, 0.9)  # full
    assert not transition_room(slots, {n: 1 for n in names}, {}, 0.9)  # memory unknown: cannot say there is room
