"""Actor slots of expert actors (`expertmesh.cluster.actor_slots`) and actor names (`expertmesh.cluster.naming`)."""

from __future__ import annotations

from collections import Counter

import pytest

from expertmesh.cluster.actor_slots import ActorSlot, NodeResources, plan_actor_slots
from expertmesh.cluster.naming import NAMESPACE, MeshNames, expert_actor_name, parse_expert_actor_name


def _names(groups: int, replicas: int) -> list[str]:
    return [expert_actor_name(g, r) for g in range(groups) for r in range(replicas)]


# ---------------------------------------------------------------- CPU-only clusters


def test_cpu_single_node_shares_cpus():
    names = _names(4, 2)
    slots = plan_actor_slots(names, [NodeResources("n0", num_cpus=2)])
    assert [s.name for s in slots] == names
    assert all(s.node_id == "n0" for s in slots)
    assert all(s.num_cpus == 0.25 for s in slots)
    assert all(s.num_gpus == 0 and s.gpu_slot is None for s in slots)
    assert all(isinstance(s, ActorSlot) for s in slots)


def test_cpu_round_robin_over_sorted_nodes():
    nodes = [NodeResources("b", num_cpus=4), NodeResources("a", num_cpus=2), NodeResources("c", num_cpus=16)]
    names = [f"x{i}" for i in range(7)]
    slots = plan_actor_slots(names, nodes)
    assert [s.node_id for s in slots] == ["a", "b", "c", "a", "b", "c", "a"]
    cpus = {s.name: s.num_cpus for s in slots}
    # a: 2 CPUs / 3 actors = 0.666.. -> floored to 0.66; b: 4/2 = 2 -> capped at 1; c: 16/2 -> 1
    assert cpus == {"x0": 0.66, "x3": 0.66, "x6": 0.66, "x1": 1.0, "x4": 1.0, "x2": 1.0, "x5": 1.0}


def test_cpu_share_at_most_one_cpu():
    slots = plan_actor_slots(["a", "b"], [NodeResources("n", num_cpus=64)])
    assert [s.num_cpus for s in slots] == [1.0, 1.0]


def test_cpu_budget_fraction():
    slots = plan_actor_slots(_names(4, 1), [NodeResources("n", num_cpus=2)], cpu_budget_fraction=0.5)
    assert [s.num_cpus for s in slots] == [0.25] * 4
    slots = plan_actor_slots(_names(8, 1), [NodeResources("n", num_cpus=2)], cpu_budget_fraction=0.5)
    assert [s.num_cpus for s in slots] == [0.12] * 8  # 0.125 floored to the hundredth


def test_cpu_share_never_exceeds_node_budget():
    for n_actors in range(1, 60):
        for cpus in (1, 2, 3, 7):
            slots = plan_actor_slots([f"a{i}" for i in range(n_actors)], [NodeResources("n", num_cpus=cpus)])
            assert sum(s.num_cpus for s in slots) <= cpus + 1e-9
            assert all(0 < s.num_cpus <= 1 for s in slots)


def test_too_few_cpus_raises():
    # 1 CPU shared by 200 actors -> 0.005 each, which floors to 0
    with pytest.raises(ValueError, match="too few CPUs"):
        plan_actor_slots([f"a{i}" for i in range(200)], [NodeResources("tiny", num_cpus=1)])
    with pytest.raises(ValueError, match="tiny"):
        plan_actor_slots(["a"], [NodeResources("tiny", num_cpus=0)])


def test_explicit_num_cpus_per_actor_honoured():
    # even beyond what the node could share: the caller asked for it
    slots = plan_actor_slots(_names(3, 1), [NodeResources("n", num_cpus=1)], num_cpus_per_actor=2.0)
    assert [s.num_cpus for s in slots] == [2.0, 2.0, 2.0]
    slots = plan_actor_slots(
        _names(4, 2), [NodeResources("g0", num_cpus=8, num_gpus=2)], num_cpus_per_actor=0.5
    )
    assert {s.num_cpus for s in slots} == {0.5}


def test_empty_inputs_rejected():
    with pytest.raises(AssertionError):
        plan_actor_slots([], [NodeResources("n", 1)])
    with pytest.raises(AssertionError):
        plan_actor_slots(["a"], [])
    with pytest.raises(AssertionError):
        plan_actor_slots(["a"], [NodeResources("n", 1)], cpu_budget_fraction=0)


# ---------------------------------------------------------------- GPU clusters


def test_gpu_two_nodes_two_gpus_eight_actors():
    nodes = [NodeResources("node-b", num_cpus=8, num_gpus=2), NodeResources("node-a", num_cpus=8, num_gpus=2)]
    names = _names(4, 2)  # expert-e0-r0, expert-e0-r1, expert-e1-r0, ...
    slots = plan_actor_slots(names, nodes)
    assert [s.name for s in slots] == names
    assert all(s.num_gpus == 0.5 for s in slots)
    per_gpu = Counter((s.node_id, s.gpu_slot) for s in slots)
    assert per_gpu == {("node-a", 0): 2, ("node-b", 0): 2, ("node-a", 1): 2, ("node-b", 1): 2}
    # interleaved: gpu0 of each node, then gpu1 of each node
    assert [(s.node_id, s.gpu_slot) for s in slots[:4]] == [("node-a", 0), ("node-b", 0), ("node-a", 1), ("node-b", 1)]
    by_name = {s.name: s for s in slots}
    for g in range(4):
        r0, r1 = by_name[expert_actor_name(g, 0)], by_name[expert_actor_name(g, 1)]
        assert r0.node_id != r1.node_id
    assert all(s.num_cpus == 1.0 for s in slots)  # 8 CPUs / 4 actors per node, capped at 1


def test_gpu_consecutive_names_on_different_gpus():
    slots = plan_actor_slots(_names(3, 2), [NodeResources("g", num_cpus=4, num_gpus=2)])
    assert [s.gpu_slot for s in slots] == [0, 1, 0, 1, 0, 1]
    assert all(s.num_gpus == pytest.approx(1 / 3) for s in slots)
    assert all(s.num_cpus == 0.66 for s in slots)


def test_gpu_one_actor_per_gpu_gets_whole_gpu():
    nodes = [NodeResources("a", num_cpus=4, num_gpus=2), NodeResources("b", num_cpus=4, num_gpus=2)]
    slots = plan_actor_slots(_names(2, 2), nodes)
    assert [s.num_gpus for s in slots] == [1.0] * 4
    assert len({(s.node_id, s.gpu_slot) for s in slots}) == 4


def test_cpu_only_nodes_get_nothing_when_gpus_exist():
    nodes = [
        NodeResources("cpu-0", num_cpus=64),
        NodeResources("gpu-0", num_cpus=8, num_gpus=1),
        NodeResources("cpu-1", num_cpus=64),
        NodeResources("gpu-1", num_cpus=8, num_gpus=1),
    ]
    slots = plan_actor_slots(_names(3, 2), nodes)
    assert {s.node_id for s in slots} == {"gpu-0", "gpu-1"}
    assert all(s.gpu_slot == 0 and s.num_gpus == pytest.approx(1 / 3) for s in slots)
    assert [s.node_id for s in slots] == ["gpu-0", "gpu-1"] * 3


def test_uneven_gpu_counts():
    nodes = [NodeResources("a", num_cpus=8, num_gpus=1), NodeResources("b", num_cpus=8, num_gpus=2)]
    slots = plan_actor_slots([f"x{i}" for i in range(6)], nodes)
    # targets: (a,0), (b,0), (b,1), repeated
    assert [(s.node_id, s.gpu_slot) for s in slots] == [("a", 0), ("b", 0), ("b", 1)] * 2
    assert all(s.num_gpus == 0.5 for s in slots)


def test_gpu_fractions_never_oversubscribe():
    nodes = [NodeResources(f"n{i}", num_cpus=16, num_gpus=g) for i, g in enumerate((1, 2, 4))]
    for n_actors in range(1, 40):
        slots = plan_actor_slots([f"a{i}" for i in range(n_actors)], nodes)
        per_gpu: dict[tuple[str, int], float] = {}
        for s in slots:
            assert 0 < s.num_gpus <= 1 and s.gpu_slot is not None
            per_gpu[(s.node_id, s.gpu_slot)] = per_gpu.get((s.node_id, s.gpu_slot), 0) + s.num_gpus
        assert all(v <= 1 + 1e-9 for v in per_gpu.values())
        per_node: dict[str, float] = {}
        for s in slots:
            per_node[s.node_id] = per_node.get(s.node_id, 0) + s.num_gpus
        num_gpus = {n.node_id: n.num_gpus for n in nodes}
        assert all(v <= num_gpus[k] + 1e-9 for k, v in per_node.items())


def test_gpu_node_too_few_cpus_raises():
    with pytest.raises(ValueError, match="too few CPUs"):
        plan_actor_slots([f"a{i}" for i in range(300)], [NodeResources("g", num_cpus=2, num_gpus=8)])


# ---------------------------------------------------------------- naming


def test_namespace():
    # Operators and drills attach from another driver with the namespace the docs give ("Actor naming"); every
    # namespace spelled out in the README and docs/, the code and the configs must be this one, so a copy cannot drift.
    import re
    from pathlib import Path

    assert NAMESPACE == "expertmesh"
    root = Path(__file__).resolve().parents[2]
    docs = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    readme = "\n".join(p.read_text() for p in docs)
    documented = set(re.findall(r'namespace="([^"]*)"', readme))  # the ray.get_actor example(s)
    assert NAMESPACE in documented, documented
    # Examples for another mesh id spell the namespace MeshNames gives it (expertmesh-<id>).
    for other in documented - {NAMESPACE}:
        assert other.startswith(f"{NAMESPACE}-"), other
        assert MeshNames.of(other.removeprefix(f"{NAMESPACE}-")).namespace == other
    spelled = {}
    folders = ("cluster", "experts", "router_service", "protos", "ops")
    code = [p for folder in folders for p in (root / folder).rglob("*") if p.suffix in (".py", ".yaml", ".sh")]
    for path in code:
        for value in re.findall(r'(?:namespace\s*=\s*|NAMESPACE\s*=\s*|namespace:\s*)["\']([^"\']*)["\']',
                                path.read_text(errors="replace")):
            spelled.setdefault(value, []).append(str(path.relative_to(root)))
    assert "cluster/naming.py" in spelled.get(NAMESPACE, [])  # the one definition was found
    assert set(spelled) == {NAMESPACE}, spelled


@pytest.mark.parametrize("group,replica", [(0, 0), (3, 1), (12, 0), (127, 15)])
def test_name_round_trip(group, replica):
    name = expert_actor_name(group, replica)
    assert name == f"expert-e{group}-r{replica}"
    assert parse_expert_actor_name(name) == (group, replica)


def test_name_pinned():
    assert expert_actor_name(3, 1) == "expert-e3-r1"
    assert parse_expert_actor_name("expert-e10-r2") == (10, 2)


@pytest.mark.parametrize(
    "bad",
    ["", "expert-e3", "expert-r1", "expert-e-r1", "expert-e3-r", "expert-ex-r1", "expert-e3-r1-extra",
     "xexpert-e3-r1", "router", "expert-e3_r1", "expert-e-1-r0", "Expert-e3-r1", " expert-e3-r1"],
)
def test_bad_names_raise(bad):
    with pytest.raises(ValueError, match="not an expert actor name"):
        parse_expert_actor_name(bad)


@pytest.mark.parametrize("bad", ["expert-e3-r1\n", "expert-e\uff13-r1"])
def test_bad_names_with_trailing_newline_or_unicode_digits_raise(bad):
    with pytest.raises(ValueError, match="not an expert actor name"):
        parse_expert_actor_name(bad)


def test_cpu_share_floors_to_exact_hundredth():
    slots = plan_actor_slots([f"a{i}" for i in range(50)], [NodeResources("n", num_cpus=29)])
    assert {s.num_cpus for s in slots} == {0.58}


def test_fixed_cpus_per_actor_fill_nodes_by_room_not_plain_round_robin():
    # The 8-node chaos drill: a 1-CPU head and 8 workers of 5 CPUs, 64 actors of 0.5 CPU. Plain round-robin put 7
    # on the head (room for 2); Ray never placed the other 5 (node affinity) and the server never became ready.
    nodes = [NodeResources("a-head", num_cpus=1)] + [NodeResources(f"w{i}", num_cpus=5) for i in range(8)]
    slots = plan_actor_slots([f"a{i}" for i in range(64)], nodes, num_cpus_per_actor=0.5)
    per_node = {}
    for s in slots:
        per_node[s.node_id] = per_node.get(s.node_id, 0) + s.num_cpus
    assert per_node["a-head"] == 1.0
    assert all(per_node[n.node_id] <= n.num_cpus for n in nodes), per_node
    assert sorted(s.name for s in slots) == sorted(f"a{i}" for i in range(64))
    # consecutive names still land on different nodes while there is room
    assert slots[0].node_id != slots[1].node_id


def test_fixed_cpus_per_actor_overflow_when_nothing_fits_keeps_round_robin():
    nodes = [NodeResources("n0", num_cpus=1), NodeResources("n1", num_cpus=1)]
    slots = plan_actor_slots([f"a{i}" for i in range(6)], nodes, num_cpus_per_actor=0.5)
    assert [s.node_id for s in slots] == ["n0", "n1", "n0", "n1", "n0", "n1"]
