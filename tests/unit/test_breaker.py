"""Circuit breaker state machine, driven by a fake clock (no Ray)."""

from __future__ import annotations

import pytest

from expertmesh.cluster.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    BreakerBoard,
    BreakerConfig,
    BreakerState,
    allow,
    ejection_seconds,
    record,
)

CFG = BreakerConfig()


def fail(st: BreakerState, times: int, t0: float = 0.0, step: float = 0.1) -> BreakerState:
    for i in range(times):
        st = record(CFG, st, t0 + i * step, ok=False)
    return st


def test_defaults_follow_envoy_outlier_detection():
    assert CFG.consecutive_failures == 5 and CFG.base_ejection_s == 30.0


def test_opens_on_the_fifth_consecutive_failure_not_before():
    st = fail(BreakerState(), 4)
    assert st.state == CLOSED
    st = fail(st, 1, t0=1.0)
    assert st.state == OPEN and st.open_until == pytest.approx(1.0 + 30.0)


def test_a_success_resets_the_consecutive_count():
    st = fail(BreakerState(), 4)
    st = record(CFG, st, 0.5, ok=True)
    st = fail(st, 4, t0=0.6)
    assert st.state == CLOSED and st.consecutive_failures == 4


def test_failure_rate_over_the_window_trips():
    st = BreakerState()
    # ok, fail, ok, fail ... : never 5 in a row, but 50% over ≥ 10 calls within 10 s.
    for i in range(10):
        st = record(CFG, st, i * 0.5, ok=i % 2 == 0)
    assert st.state == OPEN


def test_failures_spread_beyond_the_window_do_not_trip_on_rate():
    st = BreakerState()
    for i in range(20):
        st = record(CFG, st, i * 3.0, ok=i % 2 == 0)  # 50% failures but ≤ 4 calls in any 10 s window
    assert st.state == CLOSED


def test_open_rejects_until_the_ejection_ends_then_half_open_allows_one_probe():
    st = fail(BreakerState(), 5)
    ok, st = allow(CFG, st, 10.0)
    assert not ok and st.state == OPEN
    ok, st = allow(CFG, st, 31.0)
    assert ok and st.state == HALF_OPEN
    ok, st = allow(CFG, st, 31.1)
    assert not ok  # one probe at a time


def test_probe_success_closes_and_probe_failure_reopens_for_longer():
    opened = fail(BreakerState(), 5)
    _, probing = allow(CFG, opened, 31.0)
    closed = record(CFG, probing, 31.2, ok=True)
    assert closed.state == CLOSED and closed.consecutive_failures == 0
    reopened = record(CFG, probing, 31.2, ok=False)
    assert reopened.state == OPEN and reopened.trips == 2
    assert reopened.open_until == pytest.approx(31.2 + 60.0)  # the cooldown doubled


def test_ejection_time_doubles_and_is_capped():
    assert [ejection_seconds(CFG, n) for n in (1, 2, 3, 4, 5, 10)] == [30, 60, 120, 240, 300, 300]


def test_board_never_ejects_the_last_live_replica():
    board = BreakerBoard()
    for t in range(5):
        board.record("a", t * 0.1, ok=False)
        board.record("b", 1 + t * 0.1, ok=False)
    assert board.get("a").state == OPEN and board.get("b").state == OPEN
    # Both ejected: the one out longest ("a") still serves rather than dropping the shard.
    assert board.usable_replicas(("a", "b"), now=2.0) == ["a"]
    # A dead replica is never chosen; with nothing alive the shard has no replica.
    assert board.usable_replicas(("a", "b"), now=2.0, dead=frozenset({"a"})) == ["b"]
    assert board.usable_replicas(("a", "b"), now=2.0, dead=frozenset({"a", "b"})) == []


def test_board_skips_an_open_replica_while_another_is_healthy():
    board = BreakerBoard()
    for t in range(5):
        board.record("a", t * 0.1, ok=False)
    assert board.usable_replicas(("a", "b"), now=1.0) == ["b"]
    assert board.usable_replicas(("a", "b"), now=40.0) == ["a", "b"]  # "a" half-open: its probe goes through
