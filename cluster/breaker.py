"""Per-replica circuit breaker, in the spirit of Envoy's outlier detection. Pure functions; no Ray, no clock.

    closed ──(5 consecutive failures, or failure rate ≥ 50% over ≥ 10 calls in 10 s)──► open
    open ──(ejection time passed: 30 s, doubling per trip up to 300 s)──► half-open (one probe call at a time)
    half-open ──probe ok──► closed          half-open ──probe fails──► open (next, longer ejection)

State is passed in and returned (`decide(ctx, state) -> (decision, state)` style), so tests drive it with a fake
clock. `usable_replicas` never ejects the last replica of a shard that is still alive: a shard whose every replica
is open keeps the one that has been out longest rather than failing its tokens.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field, replace
from operator import itemgetter

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
_call_time = itemgetter(0)  # of a window entry (time, ok)


@dataclass(frozen=True)
class BreakerConfig:
    consecutive_failures: int = 5
    failure_rate: float = 0.5  # trip when failures / calls in the window reach this ...
    min_calls_in_window: int = 10  # ... over at least this many calls
    window_s: float = 10.0
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0

    def validate(self) -> BreakerConfig:
        assert self.consecutive_failures >= 1, "consecutive_failures must be ≥ 1"
        assert 0 < self.failure_rate <= 1, "failure_rate must be in (0, 1]"
        assert self.min_calls_in_window >= 1 and self.window_s > 0
        assert 0 < self.base_ejection_s <= self.max_ejection_s
        return self


@dataclass(frozen=True)
class BreakerState:
    state: str = CLOSED
    consecutive_failures: int = 0
    window: tuple[tuple[float, bool], ...] = ()  # (time, ok) of calls within window_s
    trips: int = 0  # how many times it opened; sets the next ejection time
    open_until: float = 0.0
    probe_in_flight: bool = False
    last_change: float = 0.0


def ejection_seconds(cfg: BreakerConfig, trips: int) -> float:
    """30 s, 60 s, 120 s, ... capped: a replica that keeps failing stays out longer each time."""
    return min(cfg.max_ejection_s, cfg.base_ejection_s * 2 ** max(0, trips - 1))


def record(cfg: BreakerConfig, st: BreakerState, now: float, ok: bool) -> BreakerState:
    """The outcome of one call to the replica (ok=False for a failure or a timeout). `now` never decreases."""
    # The window is in time order, so the calls that aged out are a prefix: found by bisection, dropped by one
    # slice (a router records a call per actor per layer, thousands per window_s: no Python loop over them).
    kept = bisect_right(st.window, now - cfg.window_s, key=_call_time)
    window = st.window[kept:] + ((now, ok),)
    if st.state == HALF_OPEN:
        if ok:
            return BreakerState(state=CLOSED, trips=st.trips, last_change=now)
        return _open(cfg, replace(st, window=()), now)
    if ok:
        return replace(st, consecutive_failures=0, window=window)
    st = replace(st, consecutive_failures=st.consecutive_failures + 1, window=window)
    if st.state == CLOSED and _should_trip(cfg, st):
        return _open(cfg, st, now)
    return st


def allow(cfg: BreakerConfig, st: BreakerState, now: float) -> tuple[bool, BreakerState]:
    """May a call go to this replica now? An open breaker whose time is up lets one probe through."""
    if st.state == CLOSED:
        return True, st
    if st.state == OPEN:
        if now < st.open_until:
            return False, st
        return True, replace(st, state=HALF_OPEN, probe_in_flight=True, last_change=now)
    # half-open: one probe at a time
    if st.probe_in_flight:
        return False, st
    return True, replace(st, probe_in_flight=True)


def _should_trip(cfg: BreakerConfig, st: BreakerState) -> bool:
    if st.consecutive_failures >= cfg.consecutive_failures:
        return True
    calls = len(st.window)
    failures = sum(1 for _, ok in st.window if not ok)
    return calls >= cfg.min_calls_in_window and failures / calls >= cfg.failure_rate


def _open(cfg: BreakerConfig, st: BreakerState, now: float) -> BreakerState:
    trips = st.trips + 1
    return BreakerState(state=OPEN, consecutive_failures=st.consecutive_failures, trips=trips,
                        open_until=now + ejection_seconds(cfg, trips), last_change=now)


@dataclass
class BreakerBoard:
    """The breakers of every replica a router talks to (keyed by actor name). A thin mutable holder."""

    cfg: BreakerConfig = field(default_factory=BreakerConfig)
    states: dict[str, BreakerState] = field(default_factory=dict)

    def get(self, actor: str) -> BreakerState:
        return self.states.get(actor, BreakerState())

    def all_closed(self) -> bool:
        """Every breaker closed: asking for usable replicas then changes nothing and returns the table's."""
        return all(st.state == CLOSED for st in self.states.values())

    def record(self, actor: str, now: float, ok: bool) -> None:
        self.states[actor] = record(self.cfg, self.get(actor), now, ok)

    def usable_replicas(self, replicas: tuple[str, ...], now: float, dead: frozenset[str] = frozenset()) -> list[str]:
        """Replicas of one shard that may take calls now, in table order. Never empty while one is alive."""
        usable = []
        for actor in replicas:
            if actor in dead:
                continue
            ok, self.states[actor] = allow(self.cfg, self.get(actor), now)
            if ok:
                usable.append(actor)
        if usable:
            return usable
        alive = [a for a in replicas if a not in dead]
        if not alive:
            return []
        # Every live replica is ejected: keep the one out longest (the last replica is never ejected).
        return [min(alive, key=lambda a: self.get(a).last_change)]
