"""When to resume a call whose router replica died, and when to give up: one rule for every front (gRPC Generate in
router_service/grpc_front.py, the OpenAI HTTP API in router_service/http_front.py). Pure (no Ray, no asyncio): the
fronts decide whether a failure was a lost replica and sleep the backoff; this keeps the count and the clock.

A call is re-sent at most `max_resumes` times, and for at most `wait_s` after a failure that no delivered event
followed: with one router replica, Serve restarts it in 8-24 s (2-core machine) and until its handle learns the
replica died, a re-sent call can land on the dead one again and fail at once; backing off (doubling from
`backoff_s` up to `backoff_max_s` within a streak) keeps that from spinning. A failure after progress (more events
delivered than at the streak's first failure) starts a new streak: a long stream may outlive several replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_RESUMES = 30
RESUME_WAIT_S = 60.0
RESUME_BACKOFF_S = 0.1
RESUME_BACKOFF_MAX_S = 2.0


@dataclass
class ResumeStreak:
    """The failures of one client request's calls. `failed(progress)` after each lost call: the seconds to back off
    before re-sending it, or None to give up (the client then gets the failure)."""

    max_resumes: int = MAX_RESUMES
    wait_s: float = RESUME_WAIT_S
    backoff_s: float = RESUME_BACKOFF_S
    backoff_max_s: float = RESUME_BACKOFF_MAX_S
    clock: Callable[[], float] = time.monotonic
    failures: int = 0  # every lost call of the request
    streak: int = 0  # lost calls in a row with no progress between them
    _streak_start: float = field(default=0.0, repr=False)
    _streak_progress: int = field(default=-1, repr=False)

    def failed(self, progress: int) -> float | None:
        """A call was lost after `progress` events (any count that only grows: tokens delivered, events relayed)."""
        now = self.clock()
        if progress != self._streak_progress:  # the lost call had made progress: a new streak
            self._streak_start, self._streak_progress, self.streak = now, progress, 0
        self.streak += 1
        self.failures += 1
        if self.failures > self.max_resumes or now - self._streak_start > self.wait_s:
            return None
        return min(self.backoff_max_s, self.backoff_s * 2 ** (self.streak - 1))

    def first_wait(self, remaining_s: float | None) -> float | None:
        """How long to wait for a call's first event: unbounded on the first attempt (a long prefill or a queue is
        not a failure), at most `wait_s` on a re-sent one (a call that landed on a dead replica can hang), and never
        past the client's deadline (`remaining_s`, None: none)."""
        if self.failures == 0:
            return None
        return bounded(self.wait_s, remaining_s)


def bounded(limit_s: float, remaining_s: float | None) -> float:
    return limit_s if remaining_s is None else max(0.0, min(limit_s, remaining_s))
