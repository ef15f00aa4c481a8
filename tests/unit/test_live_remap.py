"""Live remap on the router side (no Ray): a staged routing table takes effect only when the next step starts (the
decoder marks steps with begin_step/end_step), the switch drops retired actors from the transport, and results stay
those of the in-process reference throughout.
Also the published-table record format (cluster/table_store.py).
"""

from __future__ import annotations

import pytest
import torch

from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.cluster.table_store import decode_table, encode_table, table_of
from expertmesh.experts.gating import route
from expertmesh.experts.reference import LocalExperts
from expertmesh.router_service.dispatch import FailoverConfig, NoReplicaError, RemoteExperts
from tests.fakes import HIDDEN, NamedFakeTransport, expert_weights

LAYERS, EXPERTS = 3, 4


def _tables():
    old = {f"a{e}": [(layer, e) for layer in range(LAYERS)] for e in range(EXPERTS)}
    new = dict(old)
    new["hot0"] = [(layer, 0) for layer in range(LAYERS)]  # a replica of expert 0 on a new actor
    del new["a1"]
    new["moved1"] = [(layer, 1) for layer in range(LAYERS)]  # expert 1 moved to another actor
    union = RoutingTable.from_actor_shards({**old, **new})
    return RoutingTable.from_actor_shards(old, epoch=0), RoutingTable.from_actor_shards(new, epoch=7), union


def _step(backend: RemoteExperts, local: LocalExperts, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One 'forward': every layer in order between the step hooks; returns (remote, local) outputs per layer."""
    outs = []
    backend.begin_step()
    try:
        for layer in range(LAYERS):
            hidden = torch.randn(12, HIDDEN, generator=gen)
            routing = route(torch.randn(12, EXPERTS, generator=gen), top_k=2, renormalize=True)
            outs.append((backend.run(layer, hidden, routing), local.run(layer, hidden, routing)))
    finally:
        backend.end_step()
    return outs


def test_staged_table_applies_at_the_next_step_only():
    old, new, union = _tables()
    shards = expert_weights(LAYERS, EXPERTS)
    transport = NamedFakeTransport(union, shards)
    transport.actors = {name: object() for name in old.actors}
    backend = RemoteExperts(old, transport)
    applied: list[int] = []
    backend.on_table_applied = applied.append
    local = LocalExperts(shards, "silu")
    gen = torch.Generator().manual_seed(0)

    _step(backend, local, gen)
    # Stage in the middle of a step: layers 1.. of this step must still use the old table.
    hidden = torch.randn(12, HIDDEN, generator=gen)
    routing = route(torch.randn(12, EXPERTS, generator=gen), top_k=2, renormalize=True)
    backend.begin_step()
    backend.run(0, hidden, routing)
    backend.stage_table(new, {"hot0": object(), "moved1": object()})
    transport.submitted.clear()
    for layer in (1, 2):
        routing = route(torch.randn(12, EXPERTS, generator=gen), 2, True)
        backend.run(layer, torch.randn(12, HIDDEN, generator=gen), routing)
        # Layer 0 again within the step (the second micro-batch of an overlapped step): still the old table.
        backend.run(0, torch.randn(12, HIDDEN, generator=gen), routing)
        assert not backend.apply_if_idle(idle_s=0.0)  # an idle-time switch never lands inside a step either
    backend.end_step()
    assert backend.table is old and applied == []
    assert {a for a, *_ in transport.submitted} <= set(old.actors)

    transport.submitted.clear()
    for remote, reference in _step(backend, local, gen):
        torch.testing.assert_close(remote, reference, rtol=0, atol=1e-6)
    assert backend.table is new and applied == [7]
    used = {a for a, *_ in transport.submitted}
    assert "a1" not in used and used <= set(new.actors)
    assert "moved1" in used  # expert 1 is only there now, and some token routes to it in 3 layers of 12 tokens
    assert set(transport.actors) == set(new.actors)  # the retired actor left the transport's map


def test_replicas_added_by_a_remap_share_the_load():
    old, new, union = _tables()
    shards = expert_weights(LAYERS, EXPERTS)
    transport = NamedFakeTransport(union, shards)
    backend = RemoteExperts(old, transport)
    backend.stage_table(new, {"hot0": object(), "moved1": object()})
    gen = torch.Generator().manual_seed(1)
    logits = torch.zeros(64, EXPERTS)
    logits[:, 0] = 10.0  # every token's first choice is expert 0
    backend.begin_step()
    backend.run(0, torch.randn(64, HIDDEN, generator=gen), route(logits, top_k=2, renormalize=True))
    backend.end_step()
    counts = {a: sum(c) for a, layer, e, c, _ in transport.submitted if 0 in e}
    assert counts == {"a0": 32, "hot0": 32}


def test_dead_replica_retired_by_a_remap_is_forgotten():
    old, new, union = _tables()
    transport = NamedFakeTransport(union, expert_weights(LAYERS, EXPERTS))
    backend = RemoteExperts(old, transport)
    backend.dead.add("a1")
    backend.stage_table(new, {"hot0": object(), "moved1": object()})
    backend.switch.apply_staged()
    assert "a1" not in backend.dead and "a1" not in backend.breakers.states


def test_table_record_round_trips():
    raw = encode_table(5, {"x": [(0, 1), (2, 3)], "y": [(0, 1)]}, {"x": {"name": "x", "node_id": "n"}})
    record = decode_table(raw)
    assert record["epoch"] == 5 and record["actor_shards"] == {"x": [(0, 1), (2, 3)], "y": [(0, 1)]}
    table = table_of(record)
    assert table.epoch == 5 and table.replicas[(0, 1)] == ("x", "y")
    with pytest.raises(ValueError, match="routing-table record"):
        decode_table(b'{"epoch": 1}')


def test_an_idle_router_switches_without_waiting_for_a_step():
    old, new, union = _tables()
    transport = NamedFakeTransport(union, expert_weights(LAYERS, EXPERTS))
    backend = RemoteExperts(old, transport)
    gen = torch.Generator().manual_seed(2)
    backend.begin_step()
    backend.run(0, torch.randn(4, HIDDEN, generator=gen), route(torch.randn(4, EXPERTS, generator=gen), 2, True))
    backend.stage_table(new, {"hot0": object(), "moved1": object()})
    assert not backend.apply_if_idle(idle_s=0.0)  # a step is running
    backend.end_step()
    assert not backend.apply_if_idle(idle_s=60.0)  # a step ended just now: the next may follow at once, so wait
    assert backend.table is old
    assert backend.apply_if_idle(idle_s=0.0)
    assert backend.table is new and not backend.apply_if_idle(idle_s=0.0)  # nothing staged any more


def test_steps_from_several_threads_take_turns():
    """A step holds the backend from begin_step to end_step: another thread's layer (or idle-time switch) waits."""
    import threading

    old, new, union = _tables()
    transport = NamedFakeTransport(union, expert_weights(LAYERS, EXPERTS))
    backend = RemoteExperts(old, transport)
    gen = torch.Generator().manual_seed(3)
    hidden, routing = torch.randn(4, HIDDEN, generator=gen), route(torch.randn(4, EXPERTS, generator=gen), 2, True)
    backend.begin_step()
    other = threading.Thread(target=backend.run, args=(0, hidden, routing))
    other.start()
    other.join(0.3)
    assert other.is_alive() and transport.submitted == []  # blocked behind the running step
    backend.stage_table(new, {"hot0": object(), "moved1": object()})
    switched: list[bool] = []
    idle = threading.Thread(target=lambda: switched.append(backend.apply_if_idle(idle_s=0.0)))
    idle.start()
    idle.join(5)
    assert switched == [False] and backend.table is old
    backend.end_step()
    other.join(5)
    assert not other.is_alive() and transport.submitted


def _stand_in_tables(retire_live: bool) -> tuple[RoutingTable, RoutingTable, RoutingTable]:
    """Old: a0..a3, one replica per expert. New: a1 (lost) replaced by stand-in s0; with retire_live, a live a2 goes
    too (moved to s1)."""
    old = {f"a{e}": [(layer, e) for layer in range(LAYERS)] for e in range(EXPERTS)}
    new = {n: s for n, s in old.items() if n != "a1"} | {"s0": [(layer, 1) for layer in range(LAYERS)]}
    if retire_live:
        del new["a2"]
        new["s1"] = [(layer, 2) for layer in range(LAYERS)]
    union = RoutingTable.from_actor_shards({**old, **new})
    return RoutingTable.from_actor_shards(old, epoch=0), RoutingTable.from_actor_shards(new, epoch=3), union


def test_a_step_waiting_for_a_lost_replica_switches_to_its_stand_in():
    old, new, union = _stand_in_tables(retire_live=False)
    shards = expert_weights(LAYERS, EXPERTS)
    transport = NamedFakeTransport(union, shards)
    backend = RemoteExperts(old, transport, FailoverConfig(no_replica_policy="wait", wait_timeout_s=0.5))
    backend.dead.add("a1")  # lost: expert 1 has no live replica in the old table
    local = LocalExperts(shards, "silu")
    gen = torch.Generator().manual_seed(2)
    logits = torch.zeros(16, EXPERTS)
    logits[:, 1] = 10.0  # every token wants expert 1
    hidden = torch.randn(16, HIDDEN, generator=gen)
    routing = route(logits, top_k=2, renormalize=True)
    backend.begin_step()
    try:
        backend.stage_table(new, {"s0": object()})  # the controller's stand-in, published mid-step
        out = backend.run(0, hidden, routing)
    finally:
        backend.end_step()
    torch.testing.assert_close(out, local.run(0, hidden, routing), rtol=0, atol=1e-6)
    assert backend.table is new and "s0" in {a for a, *_ in transport.submitted}


def test_a_held_step_switches_even_when_the_table_retires_a_live_actor_with_nothing_in_flight():
    # The lost actor's shards are merged with a live actor's (a2 -> s1): a2 has no call of this step out, so the
    # switch strands nothing (the controller stops a2 only after this router acknowledges the new table).
    old, new, union = _stand_in_tables(retire_live=True)
    shards = expert_weights(LAYERS, EXPERTS)
    transport = NamedFakeTransport(union, shards)
    backend = RemoteExperts(old, transport, FailoverConfig(no_replica_policy="wait", wait_timeout_s=5.0))
    backend.dead.add("a1")
    logits = torch.zeros(4, EXPERTS)
    logits[:, 1] = 10.0
    backend.begin_step()
    try:
        backend.stage_table(new, {"s0": object(), "s1": object()})
        backend.run(0, torch.randn(4, HIDDEN), route(logits, top_k=2, renormalize=True))
    finally:
        backend.end_step()
    assert backend.table is new


def test_a_held_step_never_switches_away_from_a_live_actor_with_a_call_in_flight():
    old, new, union = _stand_in_tables(retire_live=True)
    transport = NamedFakeTransport(union, expert_weights(LAYERS, EXPERTS))
    backend = RemoteExperts(old, transport, FailoverConfig(no_replica_policy="wait", wait_timeout_s=0.2))
    backend.dead.add("a1")
    to_a2 = torch.zeros(4, EXPERTS)
    to_a2[:, 2] = 10.0
    to_a1 = torch.zeros(4, EXPERTS)
    to_a1[:, 1] = 10.0
    to_a1[:, 0] = 5.0
    backend.begin_step()
    try:
        # Overlap: layer 0's calls (to a2) are out while layer 1 waits for a replica of expert 1.
        out_first = backend.submit(0, torch.randn(4, HIDDEN), route(to_a2, top_k=1, renormalize=True))
        backend.stage_table(new, {"s0": object(), "s1": object()})
        with pytest.raises(NoReplicaError):
            backend.submit(1, torch.randn(4, HIDDEN), route(to_a1, top_k=2, renormalize=True))
        assert backend.table is old  # a2 still owes layer 0 an answer
        backend.wait(out_first)
    finally:
        backend.end_step()


class _HangingTransport(NamedFakeTransport):
    """Calls to `hung` time out (not an actor death): an actor on a node that vanished without a word."""

    hung = "a1"

    def submit(self, actor, layer, experts, counts, x):
        if actor == self.hung:
            self.submitted.append((actor, layer, list(experts), list(counts), x.shape))
            return TimeoutError(f"{actor} did not answer")
        return super().submit(actor, layer, experts, counts, x)


def test_a_step_retrying_a_timed_out_replica_switches_to_the_stand_in_that_retires_it():
    old, new, union = _stand_in_tables(retire_live=False)
    shards = expert_weights(LAYERS, EXPERTS)
    transport = _HangingTransport(union, shards)
    backend = RemoteExperts(old, transport, FailoverConfig(no_replica_policy="wait", wait_timeout_s=5.0))
    logits = torch.zeros(8, EXPERTS)
    logits[:, 1] = 10.0
    hidden = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(3))
    routing = route(logits, top_k=2, renormalize=True)
    backend.begin_step()
    try:
        backend.stage_table(new, {"s0": object()})
        out = backend.run(0, hidden, routing)
    finally:
        backend.end_step()
    torch.testing.assert_close(out, LocalExperts(shards, "silu").run(0, hidden, routing), rtol=0, atol=1e-6)
    assert "a1" not in backend.dead  # it never looked dead; its call failed, and the controller retired it
    assert backend.table is new and [a for a, *_ in transport.submitted].count("a1") == 1


def test_a_held_step_switches_when_the_controller_says_the_busy_actor_is_gone():
    # As above, but the controller lost a2 too (its node went) and says so with the table: a2's call of layer 0
    # will never answer, so layer 1 need not wait for it to time out before taking the stand-ins.
    old, new, union = _stand_in_tables(retire_live=True)
    transport = NamedFakeTransport(union, expert_weights(LAYERS, EXPERTS))
    backend = RemoteExperts(old, transport, FailoverConfig(no_replica_policy="wait", wait_timeout_s=5.0))
    backend.dead.add("a1")
    to_a2 = torch.zeros(4, EXPERTS)
    to_a2[:, 2] = 10.0
    to_a1 = torch.zeros(4, EXPERTS)
    to_a1[:, 1] = 10.0
    backend.begin_step()
    try:
        first = backend.submit(0, torch.randn(4, HIDDEN), route(to_a2, top_k=1, renormalize=True))
        backend.stage_table(new, {"s0": object(), "s1": object()}, gone=["a1", "a2"])
        assert "a2" in backend.dead
        backend.wait(backend.submit(1, torch.randn(4, HIDDEN), route(to_a1, top_k=1, renormalize=True)))
        assert backend.table is new
        backend.wait(first)
    finally:
        backend.end_step()


def test_table_record_names_the_lost_actors_it_retires():
    record = decode_table(encode_table(4, {"s0": [(0, 1)]}, gone=["a1"]))
    assert record["gone"] == ["a1"]
    assert decode_table(encode_table(4, {"s0": [(0, 1)]}))["gone"] == []
