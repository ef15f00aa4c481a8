"""The log rate limit with a hand-driven clock: a burst per key per window, the dropped lines counted and reported
on the next line let through, keys independent."""

from __future__ import annotations

from expertmesh.router_service.log_limit import LogRateLimit


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_passes_then_lines_are_dropped_until_the_window_ends():
    clock = FakeClock()
    limit = LogRateLimit(burst=3, window_s=10.0, clock=clock)
    assert [limit.admit("NOT_FOUND") for _ in range(3)] == [0, 0, 0]
    assert [limit.admit("NOT_FOUND") for _ in range(100)] == [None] * 100
    clock.now += 9.9
    assert limit.admit("NOT_FOUND") is None  # still the same window: 101 dropped so far
    clock.now += 0.1
    assert limit.admit("NOT_FOUND") == 101  # a new window: the first line says how many were dropped
    assert limit.admit("NOT_FOUND") == 0


def test_keys_are_limited_independently():
    clock = FakeClock()
    limit = LogRateLimit(burst=1, window_s=5.0, clock=clock)
    assert limit.admit("INVALID_ARGUMENT") == 0
    assert limit.admit("INVALID_ARGUMENT") is None
    assert limit.admit("RESOURCE_EXHAUSTED") == 0  # another kind of error is not hidden by the first one's flood
    clock.now += 5.0
    assert limit.admit("RESOURCE_EXHAUSTED") == 0
    assert limit.admit("INVALID_ARGUMENT") == 1


def test_lines_in_a_long_flood_stay_bounded():
    clock = FakeClock()
    limit = LogRateLimit(burst=5, window_s=10.0, clock=clock)
    let_through = 0
    for _ in range(10_000):  # 10 000 errors over 100 s
        clock.now += 0.01
        let_through += limit.admit("RESOURCE_EXHAUSTED") is not None
    assert let_through == 5 * 10
