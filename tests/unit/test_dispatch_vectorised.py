"""The vectorised planning and combine (router_service/dispatch_plan.py, experts/routed_rows.py) against main's
per-expert loops (ops/bench/dispatch_overhead.py) on random routings: the same calls, the same rows, the same bits."""

from __future__ import annotations

import random

import pytest
import torch

from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.experts.gating import DROPPED, Routing, degrade, route
from expertmesh.ops.bench.dispatch_overhead import loop_combine, loop_plan_calls
from expertmesh.router_service.dispatch_plan import ActorCall, combine, plan_calls


def _random_table(layers: int, experts: int, seed: int, max_replicas: int = 3, per_actor: int = 3) -> RoutingTable:
    """Actors hosting a few random shards each; every shard gets 1..max_replicas replicas."""
    rng = random.Random(seed)
    hosting: dict[str, list[tuple[int, int]]] = {}
    for layer in range(layers):
        for e in range(experts):
            for r in range(rng.randint(1, max_replicas)):
                name = f"a{(e // per_actor + 7 * r + layer) % max(2, experts // per_actor + 3)}-r{r}"
                if (layer, e) not in hosting.setdefault(name, []):
                    hosting[name].append((layer, e))
    return RoutingTable.from_actor_shards(hosting)


def _random_routing(tokens: int, experts: int, k: int, seed: int, drop: float = 0.0) -> Routing:
    gen = torch.Generator().manual_seed(seed)
    routing = route(torch.randn(tokens, experts, generator=gen), k, renormalize=seed % 2 == 0)
    if drop:
        dropped = torch.rand(tokens, k, generator=gen) < drop  # [T, k]
        dropped[0, -1] = True  # at least one, however few tokens
        routing = Routing(experts=routing.experts.masked_fill(dropped, DROPPED),
                          weights=routing.weights.masked_fill(dropped, 0.0), probs=routing.probs)
    return routing


def _assert_same_plan(new: list[ActorCall], old) -> None:
    assert [(c.actor, c.experts, c.counts) for c in new] == [(c.actor, c.experts, c.counts) for c in old]
    for n, o in zip(new, old):
        assert [t.tolist() for t in n.token_idx] == [t.tolist() for t in o.token_idx]
        assert [s.tolist() for s in n.slot_idx] == [s.tolist() for s in o.slot_idx]
        assert torch.equal(n.tokens, torch.cat(o.token_idx)) and torch.equal(n.slots, torch.cat(o.slot_idx))


def _outputs(calls, hidden_size: int, seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(c.counts), hidden_size, generator=gen).to(dtype) for c in calls]


CASES = [(1, 8, 2), (7, 8, 2), (64, 8, 2), (13, 64, 6), (64, 128, 8), (64, 256, 8), (200, 256, 8)]


@pytest.mark.parametrize("tokens,experts,k", CASES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("drop", [0.0, 0.2])
def test_plan_and_combine_equal_main_loops(tokens, experts, k, seed, drop):
    table = _random_table(2, experts, seed)
    hidden = torch.randn(tokens, 12, generator=torch.Generator().manual_seed(seed))
    for layer in range(2):
        routing = _random_routing(tokens, experts, k, seed * 10 + layer, drop)
        new, old = plan_calls(layer, routing, table), loop_plan_calls(layer, routing, table)
        _assert_same_plan(new, old)
        outputs = _outputs(new, 12, seed)
        got = combine(hidden, routing, new, outputs)
        assert torch.equal(got, loop_combine(hidden, routing, old, outputs))
        if drop:
            assert bool((routing.experts == DROPPED).any())


@pytest.mark.parametrize("seed", range(3))
def test_replicas_of_and_degraded_slots_equal_main_loops(seed):
    experts, k, tokens = 64, 8, 50
    table = _random_table(1, experts, seed)
    rng = random.Random(seed)
    down = {e for e in range(experts) if rng.random() < 0.2}
    available = torch.tensor([e not in down for e in range(experts)])
    routing = degrade(_random_routing(tokens, experts, k, seed), available)
    assert routing.degraded > 0

    def replicas_of(shard):  # like RemoteExperts.live_replicas: a subset, in table order
        live = [a for a in table.replicas[shard] if not a.endswith("-r1")]
        return live or list(table.replicas[shard])

    new, old = plan_calls(0, routing, table, replicas_of), loop_plan_calls(0, routing, table, replicas_of)
    _assert_same_plan(new, old)
    assert not any(set(c.experts) & down for c in new)
    hidden = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(seed))
    outputs = _outputs(new, 8, seed)
    assert torch.equal(combine(hidden, routing, new, outputs), loop_combine(hidden, routing, old, outputs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_combine_bits_in_every_dtype_and_any_call_order(dtype):
    experts, k, tokens = 128, 8, 64
    table = _random_table(1, experts, 5)
    routing = _random_routing(tokens, experts, k, 5, drop=0.1)
    hidden = torch.zeros(tokens, 16, dtype=dtype)
    new, old = plan_calls(0, routing, table), loop_plan_calls(0, routing, table)
    outputs = _outputs(new, 16, 1, dtype)
    want = loop_combine(hidden, routing, old, outputs)
    assert want.dtype == dtype and torch.equal(combine(hidden, routing, new, outputs), want)
    # The calls may come back (and be listed) in any order: the sum order is fixed by the routing alone.
    order = list(range(len(new)))
    random.Random(0).shuffle(order)
    assert torch.equal(combine(hidden, routing, [new[i] for i in order], [outputs[i] for i in order]), want)


def test_combine_with_an_expert_twice_in_a_token_adds_in_slot_order():
    # Not produced by top-k, but the combine must not depend on it: the loop added the two slots in slot order.
    routing = Routing(experts=torch.tensor([[3, 1, 3], [DROPPED, 3, 1]]),
                      weights=torch.tensor([[0.3, 0.1, 0.7], [0.0, 0.9, 0.2]]))
    table = RoutingTable.from_actor_shards({"a": [(0, 1)], "b": [(0, 3)], "b2": [(0, 3)]})
    new, old = plan_calls(0, routing, table), loop_plan_calls(0, routing, table)
    _assert_same_plan(new, old)
    hidden = torch.zeros(2, 4)
    outputs = [torch.randn(sum(c.counts), 4, generator=torch.Generator().manual_seed(3)) * 1e3 for c in new]
    assert torch.equal(combine(hidden, routing, new, outputs), loop_combine(hidden, routing, old, outputs))


def test_single_actor_hosting_everything_gets_one_call_with_all_rows():
    experts = 256
    table = RoutingTable.from_actor_shards({"node0": [(0, e) for e in range(experts)]})
    routing = _random_routing(64, experts, 8, 2)
    (call,) = plan_calls(0, routing, table)
    assert call.experts == sorted(set(routing.experts.flatten().tolist()))
    assert sum(call.counts) == 64 * 8
    ids = routing.experts[call.tokens, call.slots]  # [N]
    assert bool((ids[1:] >= ids[:-1]).all())  # grouped by expert, ascending


@pytest.mark.parametrize("experts,k", [(8, 2), (64, 8)])
def test_piece_loop_and_rank_passes_give_the_same_bits(monkeypatch, experts, k):
    # combine_pieces adds few pieces one index_add_ each and many pieces in rank passes: the same order per token.
    from expertmesh.experts import routed_rows

    table = _random_table(1, experts, 3)
    routing = _random_routing(40, experts, k, 3, drop=0.1)
    calls = plan_calls(0, routing, table)
    outputs = _outputs(calls, 8, 2)
    hidden = torch.zeros(40, 8)
    monkeypatch.setattr(routed_rows, "PIECE_LOOP_MAX", 10**6)
    by_piece = combine(hidden, routing, calls, outputs)
    monkeypatch.setattr(routed_rows, "PIECE_LOOP_MAX", 0)
    by_rank = combine(hidden, routing, calls, outputs)
    assert torch.equal(by_piece, by_rank)
    assert torch.equal(by_rank, loop_combine(hidden, routing, loop_plan_calls(0, routing, table), outputs))


def test_an_actors_contiguous_expert_slice_is_one_view_of_the_sorted_rows():
    table = RoutingTable.from_actor_shards({f"g{g}": [(0, e) for e in range(32 * g, 32 * g + 32)] for g in range(4)})
    routing = _random_routing(64, 128, 8, 4)
    calls = plan_calls(0, routing, table)
    assert [c.actor for c in calls] == ["g0", "g1", "g2", "g3"]
    base = calls[0].tokens.untyped_storage().data_ptr()
    assert all(c.tokens.untyped_storage().data_ptr() == base for c in calls)  # slices, no copies
    _assert_same_plan(calls, loop_plan_calls(0, routing, table))


@pytest.mark.parametrize("experts, per_actor, replicas", [(8, 1, 1), (256, 32, 1), (256, 256, 1), (64, 1, 2)])
def test_the_single_replica_fast_path_equals_the_general_path(experts, per_actor, replicas):
    from expertmesh.cluster.routing_table import RoutingTable
    from expertmesh.experts.gating import route
    from expertmesh.router_service.dispatch_plan import all_served, plan_calls

    gen = torch.Generator().manual_seed(experts + per_actor)
    routing = route(torch.randn(64, experts, generator=gen), 8 if experts > 8 else 2, renormalize=True)
    groups = {f"a{g}-r{r}": [(0, e) for e in range(g * per_actor, (g + 1) * per_actor)]
              for g in range(experts // per_actor) for r in range(replicas)}
    table = RoutingTable.from_actor_shards(groups)
    fast = plan_calls(0, routing, table)  # replicas_of None: the look-up path where it applies
    general = plan_calls(0, routing, table, lambda shard: list(table.replicas[shard]))
    assert [(c.actor, c.experts, c.counts) for c in fast] == [(c.actor, c.experts, c.counts) for c in general]
    for a, b in zip(fast, general):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.slots, b.slots)
    assert all_served(table, 0, routing.experts)
    partial = RoutingTable.from_actor_shards({"x": [(0, e) for e in range(experts - 1)]})
    assert all_served(partial, 0, routing.experts) == bool((routing.experts != experts - 1).all())
