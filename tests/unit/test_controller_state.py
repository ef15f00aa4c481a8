"""The controller's state objects and pure decisions, on crafted states, without Ray: the replica registry, the
persisted record, router reports, the activity log, placement changes, displaced-actor bookkeeping, node choice and
the refusals of operator actions (cluster/controller.py is a Ray shell over these)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from expertmesh.cluster.activity_log import MAX_CONTROL_STEPS, MAX_EVENTS, ActivityLog
from expertmesh.cluster.actor_slots import ActorSlot
from expertmesh.cluster.admin_checks import drain_refusal, removal_refusal, undrain_refusal
from expertmesh.cluster.controller_record import ControllerRecord
from expertmesh.cluster.displacement import displace, move_back, resource_bundles, return_groups, stand_in_placement
from expertmesh.cluster.load_stats import LoadWindow
from expertmesh.cluster.lost_restore import LostActor, NodeRoom, RestorePlan, StandIn
from expertmesh.cluster.naming import stand_in_actor_name
from expertmesh.cluster.node_choice import choose_node, node_rooms
from expertmesh.cluster.placement_change import placement_change
from expertmesh.cluster.pool_spec import PoolSpec
from expertmesh.cluster.replica_registry import SILENT, ReplicaRegistry
from expertmesh.cluster.router_reports import RouterReports


def slot(name: str, node: str, cpus: float = 1.0, gpus: float = 0.0) -> ActorSlot:
    return ActorSlot(name, node, cpus, gpus, 0 if gpus else None)


def registry(placement: dict[str, list], nodes: dict[str, str], record: ControllerRecord | None = None,
             ) -> ReplicaRegistry:
    """Actors on the given nodes, every one seen there at generation 1."""
    spec = PoolSpec("m", "float32", {}).with_actor_shards(placement)
    reg = ReplicaRegistry(spec, {n: slot(n, nodes[n]) for n in placement}, record)
    for name in placement:
        reg.seen(name, {"generation": 1, "node_id": nodes[name]})
    return reg


def two_replicas() -> ReplicaRegistry:
    """e0 has replicas r0 (node a) and r1 (node b); e1 has one replica, r0 on node a."""
    return registry({"expert-e0-r0": [[0, 0], [1, 0]], "expert-e0-r1": [[0, 0], [1, 0]], "expert-e1-r0": [[0, 1]]},
                    {"expert-e0-r0": "a", "expert-e0-r1": "b", "expert-e1-r0": "a"})


# ---- the persisted record ------------------------------------------------------------------------------------------

def test_record_keeps_the_format_earlier_controllers_wrote_and_read():
    written = {"epoch": 7, "drained": ["expert-e1-r0"], "stand_in_serial": 2, "restore_request": [{"CPU": 1.0}],
               "displaced": {"expert-e2-r0": {"slot": asdict(slot("expert-e2-r0", "gone")), "shards": [[0, 2]],
                                              "by": "expert-s1"}}}
    record, restarted = ControllerRecord.decode(json.dumps(written).encode())
    assert restarted and record.epoch == 7 and record.drained == {"expert-e1-r0"} and record.stand_in_serial == 2
    assert json.loads(record.encode()) == written  # what a restarted controller writes back reads the same


@pytest.mark.parametrize("raw", [None, b"{}"])
def test_no_record_or_a_fresh_one_means_no_previous_incarnation(raw):
    record, restarted = ControllerRecord.decode(raw)
    assert not restarted and record == ControllerRecord()


def test_a_record_from_before_displacement_reads_with_none_displaced():
    record, restarted = ControllerRecord.decode(b'{"epoch": 3, "drained": []}')
    assert restarted and record.epoch == 3 and record.displaced == {} and record.restore_request == []


# ---- the registry ------------------------------------------------------------------------------------------------

def test_resume_takes_the_published_placement_over_the_first_arguments():
    spec = PoolSpec("m", "float32", {"expert-e0-r0": [(0, 0)]})
    published = {"actor_shards": {"expert-e0-r0": [(0, 0)], "expert-e0-r1": [(0, 0)]},
                 "slots": {"expert-e0-r1": asdict(slot("expert-e0-r1", "b"))}}
    reg = ReplicaRegistry.resume(spec, [slot("expert-e0-r0", "a")], published, ControllerRecord(epoch=4))
    assert reg.expected() == ["expert-e0-r0", "expert-e0-r1"] and reg.slots["expert-e0-r1"].node_id == "b"
    assert reg.epoch == 4
    assert ReplicaRegistry.resume(spec, [slot("expert-e0-r0", "a")], None, ControllerRecord()).expected() == \
        ["expert-e0-r0"]


def test_a_pass_marks_the_silent_lost_and_restoring_only_when_restores_are_on():
    reg = two_replicas()
    names = reg.expected()
    assert reg.probed(names, [None, {"generation": 3, "node_id": "c"}, {"generation": 1, "node_id": "a"}],
                      restore=False) == (["expert-e0-r0"], [])
    assert reg.lost == {"expert-e0-r0"} and not reg.restoring and reg.nodes["expert-e0-r1"] == "c"
    assert reg.probed(names, [None, None, {"generation": 1, "node_id": "a"}], restore=True) == \
        (["expert-e0-r0", "expert-e0-r1"], ["expert-e0-r0", "expert-e0-r1"])
    assert reg.down() == {"expert-e0-r0", "expert-e0-r1"} and reg.serving() == ["expert-e1-r0"]
    reg.seen("expert-e0-r0", {"generation": 2, "node_id": "a"})
    assert "expert-e0-r0" not in reg.lost and reg.generations["expert-e0-r0"] == 2


def test_an_actor_ray_lists_but_that_does_not_answer_is_lost_only_after_misses_probes_in_a_row():
    reg = two_replicas()
    names = reg.expected()
    up = {"generation": 1, "node_id": "a"}
    assert reg.probed(names, [SILENT, up, up], restore=True, misses=2) == ([], [])  # busy, maybe: not yet
    assert not reg.lost and not reg.restoring and reg.silent == {"expert-e0-r0": 1}
    assert reg.probed(names, [up, up, up], restore=True, misses=2) == ([], [])  # answered: the count starts over
    assert reg.silent == {}
    assert reg.probed(names, [SILENT, up, up], restore=True, misses=2) == ([], [])
    assert reg.probed(names, [SILENT, up, up], restore=True, misses=2) == (["expert-e0-r0"], ["expert-e0-r0"])
    assert reg.lost == {"expert-e0-r0"} and reg.silent == {}
    assert reg.probed(names, [up, SILENT, up], restore=True) == (["expert-e0-r1"], ["expert-e0-r1"])  # misses=1


def test_a_node_where_every_actor_of_ours_is_lost_is_suspect():
    reg = two_replicas()
    reg.lost |= {"expert-e0-r0"}
    assert reg.suspect_nodes() == set()  # e1-r0 still answers on node a
    reg.lost |= {"expert-e1-r0"}
    assert reg.suspect_nodes() == {"a"}


def test_live_nodes_count_only_serving_replicas():
    reg = two_replicas()
    reg.restoring.add("expert-e0-r1")
    assert reg.live_nodes() == {(0, 0): {"a"}, (1, 0): {"a"}, (0, 1): {"a"}}


def test_the_published_table_leaves_out_drained_and_names_lost_actors_it_retires():
    reg = two_replicas()
    reg.drained.add("expert-e0-r1")
    reg.lost.add("expert-e9-r0")  # lost, then retired from the placement by a stand-in remap
    serving, slots, gone = reg.table()
    assert sorted(serving) == ["expert-e0-r0", "expert-e1-r0"] and sorted(slots) == sorted(serving)
    assert gone == ["expert-e9-r0"]
    assert reg.record().drained == {"expert-e0-r1"}


def test_restore_plan_stands_in_when_no_node_has_room_and_counts_stand_ins_from_the_serial():
    reg = two_replicas()
    reg.stand_in_serial = 3
    reg.lost |= {"expert-e1-r0"}
    plan = reg.restore_plan(["expert-e1-r0"], [NodeRoom("b", 0.5)], 0.1, stand_in_actor_name)
    assert not plan.full and list(plan.stand_ins) == ["expert-s3"]
    assert plan.stand_ins["expert-s3"].replaces == ("expert-e1-r0",) and plan.stand_ins["expert-s3"].slot.node_id == "b"
    roomy = reg.restore_plan(["expert-e1-r0"], [NodeRoom("b", 2.0)], 0.1, stand_in_actor_name)
    assert roomy.full == {"expert-e1-r0": slot("expert-e1-r0", "b")} and not roomy.stand_ins


def test_a_lost_actor_whose_slot_the_controller_never_learnt_is_still_planned():
    """A controller recreated at the tick a node went (CI chaos drill) raised KeyError on such an actor in every
    pass and restored nothing: it now plans it at the most common share, on the node it was last seen on."""
    reg = two_replicas()
    del reg.slots["expert-e1-r0"]
    reg.lost |= {"expert-e1-r0"}
    assert reg.slot_of("expert-e1-r0") == slot("expert-e1-r0", "a") and reg.node_of("expert-e1-r0") == "a"
    plan = reg.restore_plan(["expert-e1-r0"], [NodeRoom("b", 2.0)], 0.1, stand_in_actor_name)
    assert plan.full == {"expert-e1-r0": slot("expert-e1-r0", "b")}
    assert reg.actors_view()["expert-e1-r0"]["slot"]["num_cpus"] == 1.0


# ---- operator refusals --------------------------------------------------------------------------------------------

def test_kill_and_drain_refuse_to_take_a_shards_last_live_replica_unless_forced():
    reg = two_replicas()
    assert removal_refusal(reg, "expert-e0-r0", "killing", force=False) is None  # e0-r1 still serves e0
    refused = removal_refusal(reg, "expert-e1-r0", "killing", force=False)
    assert refused["code"] == "FAILED_PRECONDITION" and "(layer 0, expert 1)" in refused["message"]
    assert removal_refusal(reg, "expert-e1-r0", "killing", force=True) is None
    assert removal_refusal(reg, "expert-e7-r0", "killing", force=True)["code"] == "NOT_FOUND"
    reg.lost.add("expert-e0-r1")  # now e0-r0 is e0's last live replica
    assert drain_refusal(reg, "expert-e0-r0", force=False)["code"] == "FAILED_PRECONDITION"
    reg.drained.add("expert-e0-r1")
    assert drain_refusal(reg, "expert-e0-r1", force=True)["message"] == "expert-e0-r1 is already drained"


def test_undrain_needs_a_drained_actor_with_a_slot():
    reg = two_replicas()
    assert undrain_refusal(reg, "expert-e0-r0")["message"] == "expert-e0-r0 is not drained"
    assert undrain_refusal(reg, "nobody")["code"] == "NOT_FOUND"
    reg.drained.add("expert-e0-r0")
    assert undrain_refusal(reg, "expert-e0-r0") is None
    del reg.slots["expert-e0-r0"]
    assert "no record of where it ran" in undrain_refusal(reg, "expert-e0-r0")["message"]


# ---- placement changes and displaced actors -----------------------------------------------------------------------

def test_placement_change_adds_and_retires_and_refuses_reshaping_an_actor():
    current = {"a": [(0, 0)], "b": [(0, 1)]}
    change = placement_change(current, {"b": [(0, 1)], "c": [(0, 0)]}, slots={"c"})
    assert change.added == ["c"] and change.retired == ["a"]
    with pytest.raises(ValueError, match=r"^actor_shards: actors \['b'\] would change shards"):
        placement_change(current, {"a": [(0, 0)], "b": [(0, 2)]}, slots=set())
    with pytest.raises(ValueError, match=r"^slots: no slot for new actors \['c'\]"):
        placement_change(current, {"a": [(0, 0)], "b": [(0, 1)], "c": [(0, 0)]}, slots=set())


def stand_in_plan(stand_in: str, replaces: tuple[str, ...], deferred: tuple[str, ...] = ()) -> RestorePlan:
    return RestorePlan(stand_ins={stand_in: StandIn(slot(stand_in, "b", 0.5), ((0, 1),), replaces)},
                       deferred=deferred, request=({"CPU": 1.0},))


def test_a_stand_in_plan_records_each_displaced_actor_once_and_drops_it_from_the_placement():
    reg = two_replicas()
    plan = stand_in_plan("expert-s0", ("expert-e1-r0",), deferred=("expert-e0-r0",))
    target = stand_in_placement(reg.spec.actor_shards, reg.drained, plan)
    assert sorted(target) == ["expert-e0-r1", "expert-s0"] and target["expert-s0"] == [[0, 1]]
    records = displace(reg.displaced, plan, reg.slots, reg.spec.actor_shards)
    assert records == {"expert-e0-r0": {"slot": asdict(reg.slots["expert-e0-r0"]), "shards": [[0, 0], [1, 0]],
                                        "by": None},
                       "expert-e1-r0": {"slot": asdict(reg.slots["expert-e1-r0"]), "shards": [[0, 1]],
                                        "by": "expert-s0"}}


def test_a_lost_stand_in_hands_what_it_hosted_to_its_replacement():
    displaced = {"expert-e1-r0": {"slot": asdict(slot("expert-e1-r0", "a")), "shards": [[0, 1]], "by": "expert-s0"}}
    records = displace(displaced, stand_in_plan("expert-s1", ("expert-s0",)), {}, {})
    assert records == {}  # the stand-in itself is not displaced: only what it hosted
    assert displaced["expert-e1-r0"]["by"] == "expert-s1"


def test_moving_back_retires_a_stand_in_once_all_it_hosts_return():
    displaced = {"expert-e1-r0": {"slot": asdict(slot("expert-e1-r0", "a")), "shards": [[0, 1]], "by": "expert-s0"},
                 "expert-e2-r0": {"slot": asdict(slot("expert-e2-r0", "a")), "shards": [[0, 2]], "by": None}}
    groups = return_groups(displaced)
    assert groups == {"expert-s0": [LostActor(slot("expert-e1-r0", "a"), ((0, 1),))],
                      "expert-e2-r0": [LostActor(slot("expert-e2-r0", "a"), ((0, 2),))]}
    actor_shards = {"expert-e0-r0": [(0, 0)], "expert-s0": [(0, 1)]}
    move = move_back({"expert-s0": {"expert-e1-r0": slot("expert-e1-r0", "c")}}, actor_shards, set(), displaced)
    assert move.returning == {"expert-e1-r0": slot("expert-e1-r0", "c")} and move.retiring == ["expert-s0"]
    assert move.placement == {"expert-e0-r0": [(0, 0)], "expert-e1-r0": [[0, 1]]}
    deferred = move_back({"expert-e2-r0": {"expert-e2-r0": slot("expert-e2-r0", "c")}}, actor_shards, set(), displaced)
    assert deferred.retiring == [] and sorted(deferred.placement) == ["expert-e0-r0", "expert-e2-r0", "expert-s0"]


def test_one_resource_request_carries_both_needs():
    assert resource_bundles(2, [{"CPU": 1.0}]) == [{"GPU": 1}, {"GPU": 1}, {"CPU": 1.0}]
    assert resource_bundles(0, []) == []


# ---- nodes --------------------------------------------------------------------------------------------------------

def node(node_id: str, cpus: float = 4.0, gpus: float = 0.0) -> dict:
    return {"NodeID": node_id, "Alive": True, "Resources": {"CPU": cpus, **({"GPU": gpus} if gpus else {})}}


def test_an_actor_goes_back_to_its_own_node_while_that_is_alive():
    assert choose_node(slot("x", "a"), [node("a"), node("b")], {}, ["b", "b"]) == "a"


def test_else_to_the_least_loaded_node_of_its_kind_leaving_router_gpus_alone():
    alive = [node("cpu"), node("router", gpus=1), node("g1", gpus=2), node("g2", gpus=2)]
    kept = {"router": 1}  # the router node's only GPU is kept for a router replica: no GPU node for experts
    assert choose_node(slot("x", "dead", gpus=0.5), alive, kept, ["g1", "g1", "g2"]) == "g2"
    assert choose_node(slot("x", "dead"), alive, kept, []) == "cpu"  # a CPU slot does not take a GPU node
    assert choose_node(slot("x", "dead", cpus=8.0), alive, kept, ["g1"]) == "cpu"  # none fits: any live node


def test_rooms_leave_out_suspect_nodes():
    rooms = node_rooms([node("a"), node("b", gpus=1)], {"b": {"CPU": 1.5, "GPU": 0.5}}, suspect={"a"})
    assert rooms == [NodeRoom("b", 1.5, 0.5, True)]


# ---- routers and history ------------------------------------------------------------------------------------------

def test_routers_behind_are_the_live_ones_on_an_older_epoch():
    reports = RouterReports()
    reports.ack("r1", 3, now=100.0)
    reports.ack("r2", 2, now=100.0)
    reports.ack("silent", 1, now=50.0)
    assert reports.behind(3, now=105.0, ttl_s=10.0) == ["r2"]
    assert reports.behind(4, now=105.0, ttl_s=10.0) == ["r1", "r2"]


def test_merged_load_uses_recent_snapshots_and_forgets_long_silent_routers():
    snapshot = LoadWindow([0, 1], 4, 2).snapshot()
    reports = RouterReports()
    reports.report_load("old", snapshot, now=0.0)
    reports.report_load("new", snapshot, now=290.0)
    assert reports.merged_load(now=300.0, max_age_s=30.0)["routers"] == 1
    assert set(reports.loads) == {"old", "new"}  # 300 s is not yet too long to keep it
    assert reports.merged_load(now=301.0, max_age_s=30.0)["routers"] == 1 and set(reports.loads) == {"new"}
    assert reports.merged_load(now=400.0, max_age_s=30.0) is None


def test_activity_log_is_bounded_and_stamps_entries():
    log = ActivityLog(clock=lambda: 5.0)
    for i in range(MAX_EVENTS + 3):
        log.event("lost", f"a{i}")
    assert len(log.events) == MAX_EVENTS and log.events[0]["actor"] == "a3"
    for i in range(MAX_CONTROL_STEPS + 1):
        entry = log.control_step({"reason": str(i)})
    assert entry == {"t": 5.0, "reason": str(MAX_CONTROL_STEPS)} and len(log.control) == MAX_CONTROL_STEPS
