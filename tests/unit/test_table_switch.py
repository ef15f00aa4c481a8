"""Live remap's switching rules (router_service/table_switch.py) and the rounds still out
(router_service/pending_layers.py), with plain threads and no transport."""

from __future__ import annotations

import threading

import pytest
import torch

from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.experts.gating import Routing
from expertmesh.router_service.dispatch_plan import ActorCall
from expertmesh.router_service.pending_layers import InFlight, PendingLayer
from expertmesh.router_service.table_switch import TableSwitch

OLD = RoutingTable.from_actor_shards({"a": [(0, 0)], "b": [(0, 1)]})
NEW = RoutingTable.from_actor_shards({"a": [(0, 0)], "c": [(0, 1)]}, epoch=1)  # retires b for c


def _switch() -> tuple[TableSwitch, list]:
    events: list = []
    switch = TableSwitch(OLD, lambda table, new_actors: events.append(("adopt", table.epoch, sorted(new_actors))))
    switch.on_table_applied = lambda epoch: events.append(("applied", epoch))
    return switch, events


def test_a_staged_table_takes_over_when_the_next_step_begins_never_within_one():
    switch, events = _switch()
    switch.begin_step(lambda: events.append("reset"))
    switch.stage(NEW, {"c": object()})
    assert switch.table is OLD and switch.staged_table is NEW  # the running step keeps its placement
    switch.end_step()
    assert switch.table is OLD
    switch.begin_step(lambda: events.append("reset"))
    assert switch.table is NEW and switch.staged_table is None
    # the caller adopts the table (handles in, retired actors out) before it is current, then hears its epoch
    assert events == ["reset", ("adopt", 1, ["c"]), ("applied", 1), "reset"]
    switch.end_step()


def test_a_failing_reset_releases_the_step_guard():
    switch, _ = _switch()

    def broken():
        raise RuntimeError("reset failed")

    with pytest.raises(RuntimeError):
        switch.begin_step(broken)
    took = []
    other = threading.Thread(target=lambda: took.append(switch.step_guard.acquire(blocking=False)))
    other.start()
    other.join()
    assert took == [True]


def test_an_idle_router_switches_at_once_but_not_while_a_step_runs_or_just_ended():
    switch, _ = _switch()
    assert not switch.apply_if_idle(idle_s=0.0)  # nothing staged
    switch.begin_step(lambda: None)
    switch.stage(NEW, {})
    seen = []
    other = threading.Thread(target=lambda: seen.append(switch.apply_if_idle(idle_s=0.0)))
    other.start()
    other.join()
    assert seen == [False] and switch.table is OLD  # the step holds the guard
    switch.end_step()
    assert not switch.apply_if_idle(idle_s=60.0)  # a step ended within idle_s: the next one will switch
    assert switch.apply_if_idle(idle_s=0.0) and switch.table is NEW


def test_a_bare_round_counts_as_activity_only_outside_a_step():
    switch, _ = _switch()
    switch.round_done()
    assert switch.last_active > 0.0
    switch.last_active = 0.0
    switch.begin_step(lambda: None)
    switch.round_done()
    assert switch.last_active == 0.0  # inside a step, end_step records the activity
    switch.end_step()
    assert switch.last_active > 0.0


def test_a_held_step_switches_unless_the_new_table_retires_an_actor_still_owing_an_answer():
    switch, events = _switch()
    assert not switch.apply_while_held(lambda: set())  # nothing staged
    switch.stage(NEW, {"c": object()})
    assert not switch.apply_while_held(lambda: {"b"}) and switch.table is OLD  # b may still answer
    assert switch.apply_while_held(lambda: {"a"}) and switch.table is NEW  # a stays in the new table
    assert events == [("adopt", 1, ["c"]), ("applied", 1)]


def _pending(layer: int, actors: list[str]) -> PendingLayer:
    routing = Routing(experts=torch.zeros(2, 1, dtype=torch.int64), weights=torch.ones(2, 1))
    hidden = torch.randn(2, 4)
    calls = [ActorCall(actor) for actor in actors]
    return PendingLayer(layer, hidden, hidden, routing, routing, calls, [], None, 0.0, 0.0, None, None, 0.0)


def test_in_flight_rounds_name_the_actors_that_may_still_answer():
    out = InFlight()
    first, second = _pending(0, ["a", "b"]), _pending(0, ["b", "c"])  # two micro-batches of one layer
    out.add(first)
    out.add(second)
    assert out.actors() == {"a", "b", "c"}
    second.calls.append(ActorCall("d"))  # a replacement call of a retry round
    out.discard(second)  # found by identity, though the two rounds have equal layers and shapes
    assert out.layers == [first] and out.actors() == {"a", "b"}
    out.discard(second)  # waited for twice (a failed step's clean-up): no error
    out.clear()
    assert out.actors() == set()
