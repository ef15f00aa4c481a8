"""Per-layer dispatch (`expertmesh.router_service.dispatch`): grouping tokens into actor calls, and combining.

The transport here is a fake (tests/fakes.py) that computes the experts in process, so no Ray runtime is ever started.
"""

from __future__ import annotations

import pytest
import torch

from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.experts.gating import DROPPED, Routing, route
from expertmesh.experts.reference import LocalExperts
from expertmesh.router_service.dispatch import RemoteExperts
from expertmesh.router_service.dispatch_plan import ActorCall, combine, plan_calls
from tests.fakes import HIDDEN, FakeTransport, expert_weights


def _routing(experts: list[list[int]], weights: list[list[float]] | None = None) -> Routing:
    e = torch.tensor(experts, dtype=torch.int64)
    w = torch.tensor(weights) if weights is not None else torch.full(e.shape, 0.5)
    return Routing(experts=e, weights=w)


# ---------------------------------------------------------------- plan_calls


def test_one_call_per_actor_with_tokens():
    table = RoutingTable.from_actor_shards({f"a{e}": [(0, e)] for e in range(4)})
    routing = _routing([[0, 2], [2, 0], [0, 2]])  # experts 1 and 3 get nothing
    calls = plan_calls(0, routing, table)
    assert [c.actor for c in calls] == ["a0", "a2"]
    assert [c.experts for c in calls] == [[0], [2]]
    assert [c.token_idx[0].tolist() for c in calls] == [[0, 1, 2], [0, 1, 2]]
    assert [c.slot_idx[0].tolist() for c in calls] == [[0, 1, 0], [1, 0, 1]]
    assert [c.counts for c in calls] == [[3], [3]]


def test_actor_hosting_two_experts_gets_one_call():
    table = RoutingTable.from_actor_shards({"big": [(0, 0), (0, 1), (1, 0)], "small": [(0, 2), (0, 3)]})
    routing = _routing([[1, 0], [0, 3], [1, 3]])
    calls = plan_calls(0, routing, table)
    assert len(calls) == 2
    big, small = calls
    assert big.actor == "big" and big.experts == [0, 1]
    assert [t.tolist() for t in big.token_idx] == [[0, 1], [0, 2]]
    assert [t.tolist() for t in big.slot_idx] == [[1, 0], [0, 0]]
    assert big.counts == [2, 2]
    assert small.actor == "small" and small.experts == [3]
    assert small.counts == [2]


def test_layer_selects_the_shards():
    # the same expert id lives on a different actor in another layer
    table = RoutingTable.from_actor_shards({"l0": [(0, 0), (0, 1)], "l1": [(1, 0), (1, 1)]})
    routing = _routing([[0, 1]])
    assert [c.actor for c in plan_calls(0, routing, table)] == ["l0"]
    assert [c.actor for c in plan_calls(1, routing, table)] == ["l1"]


def test_replicas_split_tokens_and_each_actor_once():
    table = RoutingTable.from_actor_shards(
        {"e0-r0": [(0, 0)], "e0-r1": [(0, 0)], "e1-r0": [(0, 1)], "e1-r1": [(0, 1)]}
    )
    routing = _routing([[0, 1]] * 5)
    calls = plan_calls(0, routing, table)
    assert [(c.actor, c.experts, c.counts) for c in calls] == [
        ("e0-r0", [0], [2]), ("e0-r1", [0], [3]), ("e1-r0", [1], [2]), ("e1-r1", [1], [3])
    ]
    assert calls[0].token_idx[0].tolist() == [0, 1] and calls[1].token_idx[0].tolist() == [2, 3, 4]
    # a single token uses only the first replica
    calls = plan_calls(0, _routing([[1, 0]]), table)
    assert [c.actor for c in calls] == ["e0-r0", "e1-r0"]


def test_dropped_slots_are_not_dispatched():
    table = RoutingTable.from_actor_shards({"a": [(0, 0)], "b": [(0, 1)]})  # no actor for expert -1
    routing = _routing([[0, DROPPED], [DROPPED, DROPPED], [1, 0]])
    calls = plan_calls(0, routing, table)
    assert [(c.actor, c.counts) for c in calls] == [("a", [2]), ("b", [1])]
    assert calls[0].token_idx[0].tolist() == [0, 2]
    assert calls[0].slot_idx[0].tolist() == [0, 1]
    assert plan_calls(0, _routing([[DROPPED]]), table) == []


def test_missing_shard_raises():
    table = RoutingTable.from_actor_shards({"a": [(0, 0)]})
    with pytest.raises(KeyError):
        plan_calls(0, _routing([[1]]), table)


def test_plan_covers_every_slot_exactly_once():
    gen = torch.Generator().manual_seed(4)
    table = RoutingTable.from_actor_shards(
        {"x": [(0, 0), (0, 5)], "y": [(0, 0), (0, 1), (0, 2)], "z": [(0, 3), (0, 4), (0, 5)], "w": [(0, 4)]}
    )
    routing = route(torch.randn(33, 6, generator=gen), 3, renormalize=True)
    calls = plan_calls(0, routing, table)
    assert len({c.actor for c in calls}) == len(calls)
    seen = []
    for call in calls:
        for expert, t_idx, s_idx in zip(call.experts, call.token_idx, call.slot_idx):
            assert (0, expert) in table.actors[call.actor]
            assert bool((routing.experts[t_idx, s_idx] == expert).all())
            seen += list(zip(t_idx.tolist(), s_idx.tolist()))
    assert sorted(seen) == [(t, s) for t in range(33) for s in range(3)]


# ---------------------------------------------------------------- combine


def test_combine_pinned():
    hidden = torch.zeros(3, 2)
    routing = _routing([[0, 1], [1, 0], [0, DROPPED]], [[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]])
    calls = [
        ActorCall.of("b", experts=[1], token_idx=[torch.tensor([0, 1])], slot_idx=[torch.tensor([1, 0])]),
        ActorCall.of("a", experts=[0], token_idx=[torch.tensor([0, 1, 2])], slot_idx=[torch.tensor([0, 1, 0])]),
    ]
    outputs = [
        torch.tensor([[10.0, 20.0], [30.0, 40.0]]),  # expert 1 at tokens 0, 1
        torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),  # expert 0 at tokens 0, 1, 2
    ]
    out = combine(hidden, routing, calls, outputs)
    expected = torch.tensor([
        [0.75 * 1 + 0.25 * 10, 0.75 * 2 + 0.25 * 20],
        [0.5 * 3 + 0.5 * 30, 0.5 * 4 + 0.5 * 40],
        [5.0, 6.0],
    ])
    assert torch.equal(out, expected)


def test_combine_with_no_calls_is_zero_and_keeps_dtype():
    hidden = torch.ones(2, 4, dtype=torch.float64)
    out = combine(hidden, _routing([[DROPPED], [DROPPED]]), [], [])
    assert out.dtype == torch.float64 and torch.equal(out, torch.zeros(2, 4, dtype=torch.float64))


# ---------------------------------------------------------------- RemoteExperts vs LocalExperts


def _assert_matches_local(table, shards, hidden, routing, layer, exact=False):
    transport = FakeTransport(table, shards)
    remote = RemoteExperts(table, transport)
    got = remote.run(layer, hidden, routing)
    want = LocalExperts(shards, "silu").run(layer, hidden, routing)
    assert got.shape == want.shape and got.dtype == want.dtype
    if exact:
        # one replica per shard: same rows per matmul, and combine adds experts in the reference's order
        assert torch.equal(got, want)
    else:
        # replicas run a shard's rows in chunks, so matmul blocking may differ in the last bits
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert want.abs().max().item() > 1e-2  # not trivially zero
    return remote, transport


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_remote_equals_local(seed, replicas):
    layers, experts, top_k = 2, 4, 2
    shards = expert_weights(layers, experts, seed)
    table = RoutingTable.from_actor_shards(
        {f"expert-e{e}-r{r}": [(layer, e) for layer in range(layers)] for e in range(experts) for r in range(replicas)}
    )
    gen = torch.Generator().manual_seed(100 + seed)
    hidden = torch.randn(13, HIDDEN, generator=gen)
    for layer in range(layers):
        routing = route(torch.randn(13, experts, generator=gen), top_k, renormalize=seed % 2 == 0)
        remote, transport = _assert_matches_local(table, shards, hidden, routing, layer, exact=replicas == 1)
        hit = int((routing.tokens_per_expert(experts) > 0).sum())
        n_calls = len(transport.submitted)
        assert remote.calls_per_layer == {layer: n_calls}
        assert hit <= n_calls <= hit * replicas
        assert transport.gathers == 1
        assert all(s[1] == layer for s in transport.submitted)
        assert len({s[0] for s in transport.submitted}) == n_calls


def test_remote_equals_local_with_actors_hosting_several_experts():
    shards = expert_weights(1, 6, seed=7)
    # 3 actors, 2 experts each, and a second replica of the pair (4, 5)
    table = RoutingTable.from_actor_shards(
        {"p0": [(0, 0), (0, 1)], "p1": [(0, 2), (0, 3)], "p2": [(0, 4), (0, 5)], "p2b": [(0, 4), (0, 5)]}
    )
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(20, HIDDEN, generator=gen)
    routing = route(torch.randn(20, 6, generator=gen), 3, renormalize=False)
    remote, transport = _assert_matches_local(table, shards, hidden, routing, 0)
    assert remote.calls_per_layer[0] == 4
    assert sorted(s[0] for s in transport.submitted) == ["p0", "p1", "p2", "p2b"]
    for _actor, _, experts, counts, _ in transport.submitted:
        assert experts == sorted(experts) and len(experts) == 2
        assert sum(counts) > 0


def test_remote_calls_only_actors_hit():
    shards = expert_weights(1, 4)
    table = RoutingTable.from_actor_shards({f"a{e}": [(0, e)] for e in range(4)})
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))
    routing = _routing([[3, 1], [1, 3], [3, 1]], [[0.6, 0.4]] * 3)
    remote, transport = _assert_matches_local(table, shards, hidden, routing, 0, exact=True)
    assert remote.calls_per_layer == {0: 2}
    assert sorted(s[0] for s in transport.submitted) == ["a1", "a3"]


def test_remote_with_capacity_drops():
    shards = expert_weights(1, 4, seed=2)
    table = RoutingTable.from_actor_shards({f"a{e}-r{r}": [(0, e)] for e in range(4) for r in range(2)})
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(16, HIDDEN, generator=gen)
    logits = torch.randn(16, 4, generator=gen)
    logits[:, 0] += 4
    routing = route(logits, 2, renormalize=True, capacity_factor=0.5)
    assert routing.dropped > 0
    _assert_matches_local(table, shards, hidden, routing, 0)


def test_remote_all_dropped_makes_no_calls():
    shards = expert_weights(1, 2)
    table = RoutingTable.from_actor_shards({"a": [(0, 0)], "b": [(0, 1)]})
    transport = FakeTransport(table, shards)
    remote = RemoteExperts(table, transport)
    hidden = torch.randn(2, HIDDEN)
    out = remote.run(0, hidden, _routing([[DROPPED], [DROPPED]], [[0.0], [0.0]]))
    assert torch.equal(out, torch.zeros(2, HIDDEN))
    assert remote.calls_per_layer == {0: 0}
    assert transport.submitted == [] and transport.gathers == 0


def test_no_ray_runtime_was_started():
    # dispatch imports the `ray` module when a call fails (to tell a dead actor); a unit test must never start a
    # runtime
    import sys

    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()


def test_a_half_open_replica_gets_its_probe_and_closes():
    """After its ejection time an open replica must receive the one probe call its breaker grants: checking
    whether a shard has a live replica must not spend that probe."""
    from expertmesh.cluster.breaker import CLOSED, OPEN

    now = [0.0]
    table = RoutingTable.from_actor_shards({"a": [(0, 0)], "b": [(0, 0)]})
    shards = expert_weights(1, 1)
    transport = FakeTransport(table, shards)
    remote = RemoteExperts(table, transport, clock=lambda: now[0])
    for _ in range(5):
        remote.breakers.record("a", now[0], ok=False)
    assert remote.breakers.get("a").state == OPEN
    hidden = torch.randn(6, HIDDEN)
    routing = _routing([[0]] * 6, [[1.0]] * 6)
    remote.run(0, hidden, routing)
    assert {c[0] for c in transport.submitted} == {"b"}  # ejected: only b serves
    now[0] = 31.0  # past the 30 s ejection: a may take one probe
    transport.submitted.clear()
    remote.run(0, hidden, routing)
    assert "a" in {c[0] for c in transport.submitted}
    assert remote.breakers.get("a").state == CLOSED
