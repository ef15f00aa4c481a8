"""A rate limit for log lines: at most `burst` lines per `window_s` for each key, the rest counted and the count
reported on the next line let through.

Why: every refused request used to log a traceback at ERROR; under overload (RESOURCE_EXHAUSTED) or a misbehaving
client that is thousands of lines. One line per client error, and a bounded number of them per window, keeps the log
readable and the disk safe. Pure (no Ray, no gRPC); the clock is a parameter, so tests drive it by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass
class _Window:
    start: float
    lines: int = 0
    suppressed: int = 0


@dataclass
class LogRateLimit:
    burst: int = 5  # lines let through per key per window
    window_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _windows: dict[Hashable, _Window] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        assert self.burst >= 1 and self.window_s > 0, (self.burst, self.window_s)

    def admit(self, key: Hashable) -> int | None:
        """None: drop this line. Otherwise log it, with this many lines of the same key dropped since the last one
        let through (0 when none were)."""
        now = self.clock()
        window = self._windows.get(key)
        if window is None or now - window.start >= self.window_s:
            suppressed = window.suppressed if window is not None else 0
            window = self._windows[key] = _Window(start=now, suppressed=suppressed)
        if window.lines >= self.burst:
            window.suppressed += 1
            return None
        window.lines += 1
        suppressed, window.suppressed = window.suppressed, 0
        return suppressed
