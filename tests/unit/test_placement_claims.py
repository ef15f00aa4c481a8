"""The ledger of planned placements (cluster/placement_claims.py): what a plan reads as free room while earlier plans'
actors are still starting, and every way a claim ends. No Ray; a fake clock."""

from __future__ import annotations

import pytest

from expertmesh.cluster.actor_slots import ActorSlot
from expertmesh.cluster.controller_config import ControllerConfig
from expertmesh.cluster.lost_restore import NodeRoom
from expertmesh.cluster.placement_claims import ClaimLedger


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def slot(name: str, node: str, cpus: float = 1.0, gpus: float = 0.0) -> ActorSlot:
    return ActorSlot(name, node, cpus, gpus, 0 if gpus else None)


def free(rooms: list[NodeRoom]) -> dict[str, tuple[float, float]]:
    return {r.node_id: (r.free_cpus, r.free_gpus) for r in rooms}


def test_a_plan_reads_free_room_net_of_the_live_claims():
    ledger = ClaimLedger(ttl_s=10.0, clock=Clock())
    table = [NodeRoom("a", 2.0, 1.0, True), NodeRoom("b", 1.0)]
    assert ledger.claim([slot("x", "a", 1.0, 0.5), slot("y", "b")], table, by="restore") == ["x", "y"]
    assert free(ledger.net(table)) == {"a": (1.0, 0.5), "b": (0.0, 0.0)}
    assert ledger.net(table)[0].has_gpus  # only the free room changes
    assert len(ledger) == 2 and "x" in ledger


def test_a_second_claim_for_the_same_actor_keeps_the_first_and_an_unreserved_slot_is_not_claimed():
    ledger = ClaimLedger(ttl_s=10.0, clock=Clock())
    table = [NodeRoom("a", 4.0)]
    ledger.claim([slot("s", "a", 2.0)], table, by="stand_in")
    assert ledger.claim([slot("s", "a", 1.0), slot("z", "a", 0.0)], None, by="remap") == []
    assert free(ledger.net(table)) == {"a": (2.0, 0.0)}
    assert ledger.view()["claims"][0]["by"] == "stand_in"


def test_claims_end_once_the_free_table_shows_them_in_the_order_they_were_made():
    ledger = ClaimLedger(ttl_s=10.0, clock=Clock())
    table = [NodeRoom("a", 3.0)]
    ledger.claim([slot("x", "a", 1.0), slot("y", "a", 1.0)], table, by="restore")  # one plan, one snapshot
    assert ledger.reconcile([NodeRoom("a", 3.0)]) == []  # Ray has scheduled neither yet
    assert ledger.reconcile([NodeRoom("a", 2.0)]) == ["x"]  # one of them is in the table: one claim ends
    assert free(ledger.net([NodeRoom("a", 2.0)])) == {"a": (1.0, 0.0)}  # the other still counts, once
    assert ledger.reconcile([NodeRoom("a", 1.0)]) == ["y"]
    assert len(ledger) == 0 and ledger.ended == {"reflected": 2}


def test_a_claim_made_by_a_later_plan_counts_the_unseen_claims_ahead_of_it():
    ledger = ClaimLedger(ttl_s=10.0, clock=Clock())
    ledger.claim([slot("x", "a", 1.0)], [NodeRoom("a", 3.0)], by="restore")
    second = ledger.net([NodeRoom("a", 3.0)])  # the table has not caught up: the second plan sees 2.0
    assert free(second) == {"a": (2.0, 0.0)}
    ledger.claim([slot("y", "a", 1.0)], [NodeRoom("a", 3.0)], by="restore")
    assert ledger.reconcile([NodeRoom("a", 2.0)]) == ["x"]  # a drop of one share ends only the first claim
    assert "y" in ledger


def test_a_gpu_claim_ends_only_when_the_gpus_are_shown_too():
    ledger = ClaimLedger(ttl_s=10.0, clock=Clock())
    ledger.claim([slot("g", "a", 1.0, 1.0)], [NodeRoom("a", 4.0, 2.0, True)], by="restore")
    assert ledger.reconcile([NodeRoom("a", 3.0, 2.0, True)]) == []  # the CPUs fell for another reason
    assert ledger.reconcile([NodeRoom("a", 3.0, 1.0, True)]) == ["g"]


def test_a_claim_made_without_a_table_or_on_a_node_that_went_ends_only_by_release_or_deadline():
    clock = Clock()
    ledger = ClaimLedger(ttl_s=10.0, clock=clock)
    ledger.claim([slot("r", "a", 1.0)], None, by="remap")
    ledger.claim([slot("q", "gone", 1.0)], [NodeRoom("gone", 1.0)], by="restore")
    assert ledger.reconcile([NodeRoom("a", 0.0)]) == []
    clock.now += 9.9
    assert ledger.expire() == []
    clock.now += 0.1
    assert ledger.expire() == ["q", "r"] and ledger.ended == {"expired": 2}


def test_release_says_why_and_is_idempotent():
    ledger = ClaimLedger(ttl_s=10.0, clock=Clock())
    ledger.claim([slot("x", "a"), slot("y", "a"), slot("z", "a")], [NodeRoom("a", 3.0)], by="restore")
    assert ledger.release("x", "alive") and ledger.release("y", "failed") and ledger.release("z", "retired")
    assert not ledger.release("x", "failed")  # already ended: not counted twice
    assert ledger.ended == {"alive": 1, "failed": 1, "retired": 1} and len(ledger) == 0
    assert ledger.net([NodeRoom("a", 3.0)]) == [NodeRoom("a", 3.0)]


def test_net_expires_stale_claims_before_subtracting():
    clock = Clock()
    ledger = ClaimLedger(ttl_s=5.0, clock=clock)
    ledger.claim([slot("x", "a", 2.0)], None, by="remap")
    assert free(ledger.net([NodeRoom("a", 2.0)])) == {"a": (0.0, 0.0)}
    clock.now += 5.0
    assert free(ledger.net([NodeRoom("a", 2.0)])) == {"a": (2.0, 0.0)} and len(ledger) == 0


def test_the_view_lists_live_claims_with_their_age():
    clock = Clock()
    ledger = ClaimLedger(ttl_s=10.0, clock=clock)
    ledger.claim([slot("x", "a", 0.5)], None, by="remap")
    clock.now += 1.5
    assert ledger.view() == {"live": 1, "claims": [{"name": "x", "node_id": "a", "cpus": 0.5, "gpus": 0.0,
                                                     "by": "remap", "age_s": 1.5}], "ended": {}}


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("inf")])
@pytest.mark.parametrize("field", ["claim_ttl_s", "restore_unplaced_s"])
def test_claim_ttl_and_the_unplaced_limit_must_be_positive_finite_numbers(field, ttl):
    with pytest.raises(ValueError, match=field):
        ControllerConfig(**{field: ttl}).validate()


def test_expertmesh_status_shows_the_live_claims_only_while_there_are_some():
    from expertmesh.ops.commands.status import status_lines
    from expertmesh.protos import admin_pb2

    def claims_lines(count: int) -> list[str]:
        state = admin_pb2.ClusterState(model="m", router=admin_pb2.RouterStats(), placement_claims=count)
        return [line for line in status_lines(state) if line.startswith("placements starting")]

    assert claims_lines(0) == []
    assert claims_lines(2) == ["placements starting: 2 planned actors not yet in Ray's free table (counted as used "
                               "by the controller's plans)"]


def test_net_tells_apart_the_claims_of_actors_new_to_a_node_from_those_restarting_in_their_own_share():
    ledger = ClaimLedger(ttl_s=10.0, clock=Clock())
    ledger.claim([slot("home", "a", 1.0), slot("new", "a", 0.5, 0.5)], None, by="restore", reuse={"home"})
    (room,) = ledger.net([NodeRoom("a", 2.0, 1.0, True)])
    assert (room.free_cpus, room.free_gpus) == (0.5, 0.5)  # both count against the free room
    assert (room.claimed_cpus, room.claimed_gpus) == (0.5, 0.5)  # only the new one may have taken a returned share


def test_no_claim_from_another_thread_lands_between_a_plans_read_and_its_claim():
    import threading

    ledger = ClaimLedger(ttl_s=10.0, clock=Clock())
    other = threading.Thread(target=lambda: ledger.claim([slot("elastic", "a")], None, by="remap"))
    with ledger.planning():
        before = ledger.net([NodeRoom("a", 1.0)])
        other.start()
        other.join(timeout=0.2)
        assert other.is_alive() and len(ledger) == 0  # the elastic loop's remap waits for this plan's claim
        ledger.claim([slot("restored", "a")], before, by="restore")
    other.join(timeout=5)
    assert not other.is_alive() and len(ledger) == 2
