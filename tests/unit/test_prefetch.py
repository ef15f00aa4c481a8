"""Prefetch prediction (router_service/prefetch.py) and how the dispatcher addresses it (dispatch.py): recall is
counted against the served routing, gate mode pre-gates with the next layer's router, history repeats the last step,
and hints ride with an actor's call or go as a call of their own to actors this layer does not call."""

from __future__ import annotations

import pytest
import torch

from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.experts.gating import route
from expertmesh.router_service.config import ExpertsConfig
from expertmesh.router_service.dispatch import RemoteExperts
from expertmesh.router_service.prefetch import NextLayerPredictor, address_hints
from tests.fakes import HIDDEN, FakeTransport, expert_weights


def _experts(*rows):
    return torch.tensor(rows)  # [T, k]


def test_history_predicts_what_the_next_layer_used_last_step_and_counts_recall():
    p = NextLayerPredictor("history", [0, 1, 2])
    h = torch.zeros(1, HIDDEN)
    p.observe(0, _experts((0, 1)))
    assert p.predict(0, h) is None  # first step: layer 1 has not run yet
    p.observe(1, _experts((2, 3)))
    p.observe(2, _experts((1, 2)))
    assert p.predict(2, h) == (0, [0, 1])  # the step's last layer predicts the next step's first
    p.observe(0, _experts((0, 3)))  # predicted {0, 1}: one of two
    assert p.predict(0, h) == (1, [2, 3])
    p.observe(1, _experts((2, 3)))  # both
    assert p.stats()["recall"] == 3 / 4 and p.stats()["precision"] == 3 / 4


def test_gate_mode_runs_the_next_layers_router_and_wraps_to_history():
    seen = []

    def gate(layer, hidden):
        seen.append(layer)
        return torch.tensor([[3, 1], [1, -1]])  # [T, k]; -1: a dropped slot

    p = NextLayerPredictor("gate", [0, 2, 5], gate)
    assert p.predict(0, torch.zeros(2, HIDDEN)) == (2, [1, 3]) and seen == [2]
    assert p.predict(5, torch.zeros(2, HIDDEN)) is None  # wraps to layer 0, never seen yet
    p.observe(0, _experts((0, 1)))
    assert p.predict(5, torch.zeros(2, HIDDEN)) == (0, [0, 1]) and seen == [2]  # history, not the gate
    p.observe(2, _experts((3, 1), (1, 2)))
    assert (p.hits, p.actual, p.predicted) == (2, 3, 2)


def test_auto_is_gate_only_with_a_memory_budget_and_not_on_compiled():
    assert ExpertsConfig().prefetch_mode() == "off"
    assert ExpertsConfig(memory_gb=1.0).prefetch_mode() == "gate"
    assert ExpertsConfig(memory_gb=1.0).prefetch_mode("compiled") == "off"
    assert ExpertsConfig(prefetch="history").prefetch_mode() == "history"
    with pytest.raises(ValueError, match="prefetch"):
        ExpertsConfig(prefetch="always").validate()
    with pytest.raises(ValueError, match="memory_gb"):
        ExpertsConfig(memory_gb=0).validate()


class _Handle:
    def __init__(self, name, log):
        self.prefetch = self
        self.name, self.log = name, log

    def remote(self, shards):
        self.log.append((self.name, shards))


class HintTransport(FakeTransport):
    """FakeTransport that takes prefetch hints with a call, as the refs transport does, and keeps Ray-like handles
    whose `prefetch.remote` records hints sent as calls of their own."""

    takes_prefetch = True

    def __init__(self, table, shards):
        super().__init__(table, shards)
        self.side_calls: list = []
        self.riding: list = []
        self.actors = {name: _Handle(name, self.side_calls) for name in table.actors}

    def submit(self, actor, layer, experts, counts, x, prefetch=None):
        if prefetch is not None:
            self.riding.append((actor, prefetch))
        return super().submit(actor, layer, experts, counts, x)


def test_dispatcher_sends_hints_with_calls_and_to_idle_actors_and_results_are_unchanged():
    shards = expert_weights(layers=2, experts=4)
    table = RoutingTable.from_actor_shards({f"e{e}": [(0, e), (1, e)] for e in range(4)})
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))  # [T, H]
    routing = route(torch.tensor([[5.0, 4, 0, 0], [5, 4, 0, 0], [0, 5, 4, 0]]), 2, True)  # experts 0, 1, 2

    plain = RemoteExperts(table, FakeTransport(table, shards)).run(0, hidden, routing)
    transport = HintTransport(table, shards)
    remote = RemoteExperts(table, transport)
    remote.prefetcher = NextLayerPredictor("gate", [0, 1], lambda layer, h: torch.tensor([[1, 3]]))
    assert torch.equal(remote.run(0, hidden, routing), plain)  # prediction never changes a result
    assert transport.riding == [("e1", [(1, 1)])]  # e1 has a call at layer 0: the hint rides with it
    assert transport.side_calls == [("e3", [(1, 3)])] and remote.prefetch_calls == 1  # e3 has none: its own call
    remote.dead.add("e3")
    transport.side_calls.clear()
    remote.run(0, hidden, routing)
    assert transport.side_calls == []  # no hint to a dead replica


def test_hints_go_to_every_live_replica_of_each_predicted_shard():
    replicas = {(1, 0): ("a", "b"), (1, 2): ("b",), (1, 3): ("c",), (2, 0): ("d",)}
    assert address_hints(1, [2, 0, 3], replicas, dead={"c"}) == {"b": [(1, 2), (1, 0)], "a": [(1, 0)]}
    assert address_hints(1, [5], replicas, dead=set()) == {}  # a shard the table does not name
    assert address_hints(2, [0], replicas, dead={"d"}) == {}
