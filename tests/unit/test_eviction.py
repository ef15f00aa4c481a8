"""The eviction orders (experts/eviction.py) with a fake clock: each ranks unpinned resident shards, first to leave
first, and on the decode cycle layer-cycle keeps what LRU throws away."""

from __future__ import annotations

import pytest

from expertmesh.experts.eviction import ARCOrder, LayerCycleOrder, LFRUOrder, LRUOrder, make_eviction_order
from expertmesh.experts.setting_choices import EVICTION_POLICIES


def test_lru_orders_by_last_use_and_unused_first():
    order = LRUOrder()
    order.on_use([(1, 0)], 1.0)
    order.on_use([(0, 0)], 2.0)
    assert order.order([(0, 0), (1, 0), (2, 0)], 3.0) == [(2, 0), (1, 0), (0, 0)]  # (2, 0) never used: oldest
    order.on_evict((0, 0))
    assert (0, 0) not in order.last_used


def test_lru_same_clock_reading_keeps_call_order():
    order = LRUOrder()
    order.on_use([(3, 0)], 1.0)
    order.on_use([(0, 0)], 1.0)
    assert order.order([(0, 0), (3, 0)], 1.0) == [(3, 0), (0, 0)]


def test_lfru_keeps_a_frequent_shard_over_a_more_recent_one():
    order = LFRUOrder(window_s=10.0)
    for t in range(4):
        order.on_use([(0, 0)], float(t))
    order.on_use([(1, 0)], 5.0)
    order.on_use([(2, 0)], 6.0)
    assert order.order([(0, 0), (1, 0), (2, 0)], 7.0) == [(1, 0), (2, 0), (0, 0)]
    assert order.order([(0, 0), (1, 0), (2, 0)], 20.0)[0] == (0, 0)  # its uses left the window: oldest again


def test_arc_evicts_once_used_before_reused():
    order = ARCOrder(capacity=3)
    for shard in [(0, 0), (1, 0), (2, 0)]:
        order.on_admit(shard, 0.0)
    order.on_use([(0, 0)], 1.0)  # (0, 0) to T2
    assert order.order([(0, 0), (1, 0), (2, 0)], 2.0) == [(1, 0), (2, 0), (0, 0)]


def test_arc_ghost_hit_adapts_target():
    order = ARCOrder(capacity=2)
    order.on_admit((0, 0), 0.0)
    order.on_admit((1, 0), 0.0)
    order.on_evict((0, 0))  # to ghost list B1
    assert (0, 0) in order.b1 and order.p == 0.0
    order.on_admit((0, 0), 1.0)  # seen again after eviction: T1 was too small
    assert order.p >= 1.0 and (0, 0) in order.t2 and (0, 0) not in order.b1


def test_arc_ghost_lists_are_bounded_by_capacity():
    order = ARCOrder(capacity=2)
    for layer in range(6):
        order.on_admit((layer, 0), 0.0)
        order.on_evict((layer, 0))
    assert len(order.b1) == 2


def test_layer_cycle_evicts_the_layer_that_comes_back_last():
    order = LayerCycleOrder(layers=[0, 1, 2, 3])
    order.on_use([(1, 0)], 1.0)  # computing layer 1: next come 2, 3, 0, then 1 again
    assert order.order([(0, 0), (2, 0), (3, 0)], 1.0) == [(0, 0), (3, 0), (2, 0)]
    assert order.distance((1, 0)) == 4 and order.distance((2, 0)) == 1


def _cycle_misses(name: str, capacity: int, layers: int, steps: int) -> int:
    """One actor, decode over `layers` layers for `steps` steps with a budget of `capacity` shards."""
    order = make_eviction_order(name, layers=range(layers), capacity=capacity)
    resident: set = set()
    misses = 0
    for t in range(steps * layers):
        shard = (t % layers, 0)
        order.on_use([shard], float(t))
        if shard in resident:
            continue
        misses += 1
        if len(resident) >= capacity:
            victim = order.order(sorted(resident), float(t))[0]
            resident.discard(victim)
            order.on_evict(victim)
        resident.add(shard)
        order.on_admit(shard, float(t))
    return misses


def test_on_the_decode_cycle_lru_always_misses_and_layer_cycle_is_optimal():
    steps = 10
    assert _cycle_misses("lru", 2, 4, steps) == 4 * steps
    # Belady on a cycle keeps capacity-1 shards and rotates one slot: (L - (k - 1)) misses per step after warm-up
    assert _cycle_misses("layer-cycle", 2, 4, steps) <= 2 + 3 * steps
    assert _cycle_misses("layer-cycle", 3, 4, steps) <= 3 + 2 * steps


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_every_named_order_ranks_exactly_its_candidates(name):
    order = make_eviction_order(name, layers=[0, 1, 2], capacity=2)
    for layer in range(3):
        order.on_admit((layer, 1), 0.0)
        order.on_use([(layer, 1)], float(layer))
    assert sorted(order.order([(0, 1), (2, 1)], 5.0)) == [(0, 1), (2, 1)]


def test_unknown_name_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="eviction"):
        make_eviction_order("mru")


def test_layers_until():
    from expertmesh.experts.eviction import layers_until

    layers = [0, 1, 2, 3]
    assert [layers_until(layer, 1, layers) for layer in layers] == [3, 4, 1, 2]
    assert layers_until(2, None, layers) == 4  # nothing ran yet: a full cycle


def test_lru_counts_a_shard_brought_in_ahead_as_new():
    order = LRUOrder()
    order.on_use([(0, 0)], 1.0)
    order.on_admit((1, 0), 2.0)  # prefetched, no call used it yet
    assert order.order([(0, 0), (1, 0)], 3.0) == [(0, 0), (1, 0)]
