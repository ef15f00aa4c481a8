"""The residency policy (experts/residency_policy.py) with a fake clock: LRU order, pinned shards never leave, shards
hot over the load window leave last, and "no room" is said rather than guessed."""

from __future__ import annotations

from expertmesh.experts.residency_policy import ResidencyPolicy

MB = 1 << 20


def _resident(*shards, size=MB):
    return {s: size for s in shards}


def test_fits_without_evicting():
    policy = ResidencyPolicy(budget_bytes=3 * MB)
    assert policy.victims(_resident((0, 0), (0, 1)), MB, pinned=(), now=0.0) == []


def test_least_recently_used_leaves_first():
    policy = ResidencyPolicy(budget_bytes=3 * MB)
    for t, shard in enumerate([(0, 0), (1, 0), (2, 0)]):
        policy.record_use([shard], now=float(t))
    policy.record_use([(0, 0)], now=3.0)  # (0, 0) is now the most recent; each shard used once or twice
    resident = _resident((0, 0), (1, 0), (2, 0))
    # (0, 0) has 2 uses against a mean of 4/3: hot, so it goes last whatever its recency
    assert policy.victims(resident, MB, pinned=(), now=4.0) == [(1, 0)]
    assert policy.victims(resident, 2 * MB, pinned=(), now=4.0) == [(1, 0), (2, 0)]


def test_even_load_is_plain_lru():
    """Decode cycling through the layers: every shard used as often, so none is hot and recency decides."""
    policy = ResidencyPolicy(budget_bytes=2 * MB)
    for t, layer in enumerate([0, 1, 2, 0, 1, 2]):
        policy.record_use([(layer, 0)], now=float(t))
    assert policy.eviction_order([(0, 0), (1, 0), (2, 0)], now=6.0) == [(0, 0), (1, 0), (2, 0)]


def test_pinned_shards_never_leave():
    policy = ResidencyPolicy(budget_bytes=2 * MB)
    policy.record_use([(0, 0)], now=0.0)
    policy.record_use([(1, 0)], now=1.0)
    resident = _resident((0, 0), (1, 0))
    assert policy.victims(resident, MB, pinned={(0, 0)}, now=2.0) == [(1, 0)]
    assert policy.victims(resident, MB, pinned={(0, 0), (1, 0)}, now=2.0) is None
    assert policy.victims(resident, 3 * MB, pinned={(0, 0)}, now=2.0) is None  # evicting all unpinned is not enough


def test_hot_shard_is_kept_over_colder_older_ones_until_the_window_passes():
    policy = ResidencyPolicy(budget_bytes=3 * MB, window_s=10.0)
    for t in range(5):
        policy.record_use([(0, 0)], now=float(t))  # hot: five uses
    policy.record_use([(1, 0)], now=5.0)
    policy.record_use([(2, 0)], now=6.0)
    resident = _resident((0, 0), (1, 0), (2, 0))
    assert policy.victims(resident, MB, pinned=(), now=7.0) == [(1, 0)]  # (0, 0) is the oldest but hot
    # 10 s later its uses have left the window: it is cold again and, being oldest, leaves first
    assert policy.uses_in_window((0, 0), now=14.5) == 0
    assert policy.victims(resident, MB, pinned=(), now=14.5) == [(0, 0)]


def test_a_shard_never_used_counts_as_oldest_and_order_is_deterministic():
    policy = ResidencyPolicy(budget_bytes=2 * MB)
    policy.record_use([(0, 1)], now=1.0)
    assert policy.eviction_order([(0, 1), (0, 3), (0, 2)], now=2.0) == [(0, 2), (0, 3), (0, 1)]


def test_forget_drops_recency():
    policy = ResidencyPolicy(budget_bytes=MB)
    policy.record_use([(0, 0)], now=5.0)
    policy.forget((0, 0))
    assert (0, 0) not in policy.order.last_used
