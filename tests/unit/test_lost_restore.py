"""Re-planning lost expert actors onto survivors without spare capacity (`expertmesh.cluster.lost_restore`)."""

from __future__ import annotations

from expertmesh.cluster.actor_slots import ActorSlot
from expertmesh.cluster.lost_restore import LostActor, NodeRoom, bundle, plan_restore, plan_return
from expertmesh.cluster.naming import is_expert_actor_name, stand_in_actor_name


def lost(expert: int, node: str = "dead", cpus: float = 1.0, gpus: float = 0.0, layers: int = 2) -> LostActor:
    """Actor expert-e{expert}-r0 that hosted expert `expert` of every layer, on `node`."""
    name = f"expert-e{expert}-r0"
    return LostActor(ActorSlot(name, node, cpus, gpus, 0 if gpus else None),
                     tuple((layer, expert) for layer in range(layers)))


def slot(name: str, node: str, cpus: float = 1.0, gpus: float = 0.0) -> ActorSlot:
    return ActorSlot(name, node, cpus, gpus, 0 if gpus else None)


def normal_slots() -> list[ActorSlot]:
    return [slot("expert-e0-r0", "a"), slot("expert-e1-r0", "a")]


def test_fits_at_normal_share_is_a_plain_restore_and_requests_nothing():
    plan = plan_restore([lost(2)], [NodeRoom("a", 0.0), NodeRoom("b", 1.5)], {}, normal_slots(),
                        stand_in_name=stand_in_actor_name)
    assert plan.full == {"expert-e2-r0": slot("expert-e2-r0", "b")}
    assert not plan.stand_ins and not plan.deferred and plan.request == ()


def test_fits_by_shrinking_shares():
    plan = plan_restore([lost(2), lost(3)], [NodeRoom("a", 0.5)], {}, normal_slots(),
                        stand_in_name=stand_in_actor_name, min_cpus=0.1)
    assert not plan.full
    assert sorted(plan.stand_ins) == ["expert-s0", "expert-s1"]
    by_replaced = {s.replaces: s for s in plan.stand_ins.values()}
    assert set(by_replaced) == {("expert-e2-r0",), ("expert-e3-r0",)}  # one smaller actor per lost one
    assert all(s.slot.num_cpus == 0.25 and s.slot.node_id == "a" for s in plan.stand_ins.values())
    assert by_replaced[("expert-e2-r0",)].shards == ((0, 2), (1, 2))
    assert "smaller shares" in plan.reason


def test_merges_when_even_shrinking_cannot():
    # 0.15 CPU free for three lost actors: 0.05 each is under min_cpus, so one stand-in gets all of it.
    plan = plan_restore([lost(2), lost(3), lost(4)], [NodeRoom("a", 0.15)], {}, normal_slots(),
                        stand_in_name=stand_in_actor_name, min_cpus=0.1)
    (stand_in,) = plan.stand_ins.values()
    assert stand_in.replaces == ("expert-e2-r0", "expert-e3-r0", "expert-e4-r0")
    assert stand_in.shards == tuple(sorted((layer, e) for e in (2, 3, 4) for layer in range(2)))
    assert stand_in.slot.num_cpus == 0.15
    assert "merged into 1" in plan.reason


def test_nothing_free_merges_into_one_unreserved_stand_in_per_node():
    plan = plan_restore([lost(2), lost(3)], [NodeRoom("a", 0.0)], {}, normal_slots(),
                        stand_in_name=stand_in_actor_name)
    (stand_in,) = plan.stand_ins.values()
    assert stand_in.slot.num_cpus == 0.0 and stand_in.slot.num_gpus == 0.0
    assert stand_in.replaces == ("expert-e2-r0", "expert-e3-r0")


def test_requests_the_missing_capacity_as_every_actor_at_its_normal_share():
    plan = plan_restore([lost(2, gpus=0.5), lost(3, gpus=0.5)], [NodeRoom("a", 0.0, 0.0, has_gpus=True)], {},
                        [slot("expert-e0-r0", "a", gpus=0.5), slot("expert-e1-r0", "a", gpus=0.5)],
                        stand_in_name=stand_in_actor_name)
    assert plan.request == tuple({"CPU": 1.0, "GPU": 0.5} for _ in range(4))
    assert bundle(slot("x", "a", cpus=0.25)) == {"CPU": 0.25}


def test_shard_with_a_live_replica_elsewhere_is_deferred_not_restored():
    live = {(0, 2): {"a"}, (1, 2): {"a"}}  # expert 2 still has a replica on a; expert 3 has none
    plan = plan_restore([lost(2), lost(3)], [NodeRoom("a", 0.0)], live, normal_slots(),
                        stand_in_name=stand_in_actor_name)
    assert plan.deferred == ("expert-e2-r0",)
    (stand_in,) = plan.stand_ins.values()
    assert stand_in.replaces == ("expert-e3-r0",)
    assert plan.displaced == ["expert-e2-r0", "expert-e3-r0"]
    assert plan.request  # the deferred replica is wanted back too


def test_never_two_replicas_of_a_shard_on_one_node_when_avoidable():
    # Expert 2 keeps a live replica on node a; its lost replica's stand-in goes to b although a has more room.
    live = {(0, 2): {"a"}, (1, 2): {"a"}}
    lost_replica = LostActor(slot("expert-e2-r1", "dead"), ((0, 2), (1, 2)))
    plan = plan_restore([lost_replica, lost(3)], [NodeRoom("a", 0.8), NodeRoom("b", 0.2)], live, normal_slots(),
                        stand_in_name=stand_in_actor_name, min_cpus=0.1)
    # expert-e2-r1 has a live replica, so it waits; force a stand-in by giving it no live replica view at all:
    assert plan.deferred == ("expert-e2-r1",)
    full_live = {(0, 2): {"a"}}  # only layer 0 is live elsewhere: it must be stood in for
    plan = plan_restore([lost_replica], [NodeRoom("a", 0.8), NodeRoom("b", 0.2)], full_live, normal_slots(),
                        stand_in_name=stand_in_actor_name)
    (stand_in,) = plan.stand_ins.values()
    assert stand_in.slot.node_id == "b"
    # At normal size too: the node without a replica wins over the one with more room.
    plan = plan_restore([lost_replica], [NodeRoom("a", 3.0), NodeRoom("b", 1.0)], full_live, normal_slots(),
                        stand_in_name=stand_in_actor_name)
    assert plan.full["expert-e2-r1"].node_id == "b"


def test_back_to_the_normal_plan_when_capacity_returns():
    waiting = {"expert-s0": [lost(2), lost(3)], "expert-e4-r0": [lost(4)]}
    # Room for three actors: everything comes back at its normal share on the new node.
    back = plan_return(waiting, [NodeRoom("a", 0.0), NodeRoom("new", 3.0)], {})
    assert back == {"expert-s0": {"expert-e2-r0": slot("expert-e2-r0", "new"),
                                  "expert-e3-r0": slot("expert-e3-r0", "new")},
                    "expert-e4-r0": {"expert-e4-r0": slot("expert-e4-r0", "new")}}
    # Room for two: groups take room in name order (the deferred e4 first), and the pair, now short, waits.
    back = plan_return(waiting, [NodeRoom("new", 2.0)], {})
    assert list(back) == ["expert-e4-r0"]
    # A group comes back whole or not at all.
    assert plan_return({"expert-s0": [lost(2), lost(3)]}, [NodeRoom("new", 1.5)], {}) == {}
    # With room for everything, the restore plan itself is the normal one again: no stand-ins, no request.
    plan = plan_restore([lost(2), lost(3)], [NodeRoom("new", 2.0)], {}, normal_slots(),
                        stand_in_name=stand_in_actor_name)
    assert set(plan.full) == {"expert-e2-r0", "expert-e3-r0"} and plan.request == ()


def test_gpu_slot_never_lands_on_a_cpu_node_at_normal_size():
    plan = plan_restore([lost(2, gpus=0.5)], [NodeRoom("cpu", 8.0)], {}, [], stand_in_name=stand_in_actor_name)
    assert not plan.full and len(plan.stand_ins) == 1
    (stand_in,) = plan.stand_ins.values()
    assert stand_in.slot.num_gpus == 0.0 and stand_in.slot.gpu_slot is None  # a stand-in on CPU


def test_no_live_node_defers_everything():
    plan = plan_restore([lost(2)], [], {}, [], stand_in_name=stand_in_actor_name)
    assert plan.deferred == ("expert-e2-r0",) and not plan.stand_ins and plan.request == ({"CPU": 1.0},)


def test_stand_in_names_are_expert_actor_names():
    assert stand_in_actor_name(3) == "expert-s3"
    assert is_expert_actor_name("expert-s3") and not is_expert_actor_name("expert-s")


def test_stand_in_for_a_gpu_actor_stays_on_gpu_nodes_while_there_are_any():
    # The CPU-only head has a free CPU, the full GPU survivor has none: the stand-in still goes to the GPU node.
    rooms = [NodeRoom("head", 1.0), NodeRoom("gpu", 0.0, 0.0, has_gpus=True)]
    plan = plan_restore([lost(2, gpus=0.5), lost(3, gpus=0.5)], rooms, {}, [], stand_in_name=stand_in_actor_name)
    (stand_in,) = plan.stand_ins.values()
    assert stand_in.slot.node_id == "gpu" and stand_in.replaces == ("expert-e2-r0", "expert-e3-r0")


def test_an_actor_killed_on_a_live_node_comes_back_there_even_before_the_free_table_shows_its_share():
    # Its node is full in Ray's (stale) table, but its own share returns there when it dies: a plain restore.
    plan = plan_restore([lost(2, node="a")], [NodeRoom("a", 0.0), NodeRoom("b", 0.0)], {}, normal_slots(),
                        stand_in_name=stand_in_actor_name)
    assert plan.full == {"expert-e2-r0": slot("expert-e2-r0", "a")} and plan.request == ()
    # That share is its own: another lost actor cannot use it.
    plan = plan_restore([lost(2, node="a"), lost(3)], [NodeRoom("a", 0.0)], {}, normal_slots(),
                        stand_in_name=stand_in_actor_name)
    assert set(plan.full) == {"expert-e2-r0"} and plan.displaced == ["expert-e3-r0"]


def test_an_actor_whose_home_share_was_taken_fits_by_free_room_like_anywhere_else():
    # Its restart at home waited unplaced (another actor got the share it gave back): the next plan does not trust
    # home; with a's table full it goes to b if b has room, else it is displaced.
    rooms = [NodeRoom("a", 0.0), NodeRoom("b", 1.0)]
    plan = plan_restore([lost(2, node="a")], rooms, {}, normal_slots(), stand_in_name=stand_in_actor_name,
                        home_taken={"expert-e2-r0"})
    assert plan.full == {"expert-e2-r0": slot("expert-e2-r0", "b")}
    plan = plan_restore([lost(2, node="a")], [NodeRoom("a", 0.0)], {(0, 2): {"b"}, (1, 2): {"b"}}, normal_slots(),
                        stand_in_name=stand_in_actor_name, home_taken={"expert-e2-r0"})
    assert not plan.full and plan.deferred == ("expert-e2-r0",) and plan.request  # its shards live on b: it waits
    # Another actor's taken home changes nothing for this one.
    plan = plan_restore([lost(2, node="a")], [NodeRoom("a", 0.0)], {}, normal_slots(),
                        stand_in_name=stand_in_actor_name, home_taken={"expert-e3-r0"})
    assert plan.full == {"expert-e2-r0": slot("expert-e2-r0", "a")}
