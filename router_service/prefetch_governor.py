"""Keep prefetch hints on only while they make decode steps faster (`experts.prefetch_governor`; README: Offload).

A prefetch pays when its load overlaps compute for free: on a GPU node a pinned host → device copy is a DMA that takes
no core. Where the copy needs the same cores as the forward (a CPU-only node; on the 2-core benchmark box gate
prefetch ran decode at 29.8 tok/s against 49.1 on demand), or where the prediction misses often enough that the loads
it queues delay the ones the next call needs, hiding the wait does not shorten the step, and hints cost more than they
save. No prediction-side measure (precision, recall, the gate's margin) sees that; only the step's time does.

So the governor measures it, like an A/B test run inside the serving loop: it alternates windows of `window_steps`
decode steps with hints on and off, `rounds` pairs, and keeps hints on only when the on windows' median time per
sequence-row is below the off windows'. A pair whose on and off windows differ by more than `decisive` (a share
of the faster) decides at once, like a sequential test stopping early: measuring costs the losing mode's windows,
and at one stream on the 2-core box hints made a step 25-130 % slower, so three pairs cost more than the verdict
saved. The verdict holds for `hold_steps` decode steps, then it measures again
(the workload, the residency or the node's load may have changed). A measurement that repeats the previous verdict
doubles the hold, up to `max_hold_factor` × `hold_steps`, and a changed verdict resets it: measuring costs the
losing mode's windows (3 × 8 steps of 256 by default), and a workload whose answer does not change should stop paying
that. The first step of every window is not counted: it
pays for the previous window's choice (shards the other mode left resident or not). Prefill and mixed steps are not
measured (their time depends on prompt lengths, not on the hints) and follow the current verdict.

Pure: numbers in, a yes/no out; no torch, no Ray. Tested in tests/unit/test_prefetch_governor.py.

    gov = PrefetchGovernor(GovernorSettings())
    gov.begin(decode=True, rows=16)   # a step starts
    if gov.hinting: ...              # send this step's hints
    gov.end(seconds)                 # the step's wall time
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GovernorSettings:
    window_steps: int = 8  # decode steps per measuring window (the first one is not counted)
    rounds: int = 3  # on/off window pairs per measurement
    hold_steps: int = 256  # decode steps a verdict holds before the next measurement
    max_hold_factor: int = 16  # a verdict repeated in a row holds up to this many times hold_steps
    decisive: float = 0.25  # a pair this far apart (share of the faster window) decides without the other pairs

    def __post_init__(self) -> None:
        assert (self.window_steps >= 2 and self.rounds >= 1 and self.hold_steps >= 0 and self.max_hold_factor >= 1
                and self.decisive >= 0), self


@dataclass
class _Window:
    hinting: bool
    steps: int = 0  # decode steps run in it (counted or not)
    seconds: float = 0.0  # of the counted ones
    rows: int = 0


@dataclass
class PrefetchGovernor:
    settings: GovernorSettings = field(default_factory=GovernorSettings)
    verdict: bool = True  # hints on between measurements (True until the first measurement says otherwise)
    measuring: bool = True
    held: int = 0  # decode steps since the last verdict
    hold: int = field(init=False)  # decode steps the current verdict holds (settings.hold_steps, doubled by repeats)
    windows: list[_Window] = field(default_factory=list)
    verdicts: list[dict] = field(default_factory=list)  # every measurement's outcome, for stats and the bench
    _step: tuple[bool, int] | None = None  # (decode, rows) of the step that began

    def __post_init__(self) -> None:
        self.hold = self.settings.hold_steps

    @property
    def hinting(self) -> bool:
        """Whether the step that began sends hints."""
        if self.measuring and self.windows:
            return self.windows[-1].hinting
        return self.verdict

    def begin(self, decode: bool, rows: int) -> None:
        """A step starts: decode (every sequence feeds one token) over `rows` sequences."""
        if decode and self.measuring and (not self.windows or self.windows[-1].steps >= self.settings.window_steps):
            # Windows alternate on, off, on, off, ...: a pair's two halves see nearly the same workload.
            self.windows.append(_Window(hinting=len(self.windows) % 2 == 0))
        self._step = (decode, rows)

    def end(self, seconds: float) -> None:
        """The step that began took `seconds` (wall time of its forward)."""
        step, self._step = self._step, None
        if step is None or not step[0]:
            return
        rows = step[1]
        if not self.measuring:
            self.held += 1
            if self.held >= self.hold:
                self.measuring, self.windows = True, []
            return
        window = self.windows[-1]
        if window.steps > 0:  # the first step of a window pays for the previous window's mode
            window.seconds += seconds
            window.rows += rows
        window.steps += 1
        if window.steps < self.settings.window_steps or window.hinting:
            return  # the pair is not complete yet
        if len(self.windows) == 2 * self.settings.rounds or self._decisive():
            self._decide()

    def _decisive(self) -> bool:
        """Every complete pair so far had its on and off windows more than `decisive` apart, the same way round."""
        pairs = [(on.seconds / on.rows, off.seconds / off.rows)
                 for on, off in zip(self.windows[::2], self.windows[1::2]) if on.rows and off.rows]
        if not pairs:
            return False
        margin = 1.0 + self.settings.decisive
        return all(on > off * margin for on, off in pairs) or all(off > on * margin for on, off in pairs)

    def _decide(self) -> None:
        on = [w.seconds / w.rows for w in self.windows if w.hinting and w.rows]
        off = [w.seconds / w.rows for w in self.windows if not w.hinting and w.rows]
        on_s, off_s = statistics.median(on), statistics.median(off)
        verdict = on_s < off_s  # a tie goes to no hints: the same speed for fewer bytes moved
        repeated = bool(self.verdicts) and self.verdicts[-1]["hints"] == verdict
        self.hold = (min(2 * self.hold, self.settings.max_hold_factor * self.settings.hold_steps)
                     if repeated else self.settings.hold_steps)
        if verdict != self.verdict:
            log.info("prefetch governor: hints %s (%.3f ms per row with hints, %.3f ms without)",
                     "on" if verdict else "off", on_s * 1e3, off_s * 1e3)
        self.verdict, self.measuring, self.held, self.windows = verdict, False, 0, []
        self.verdicts.append({"hints": verdict, "on_s_per_row": on_s, "off_s_per_row": off_s})

    def stats(self) -> dict:
        last = self.verdicts[-1] if self.verdicts else None
        return {"hints": self.verdict, "measuring": self.measuring, "measurements": len(self.verdicts),
                "measurements_on": sum(v["hints"] for v in self.verdicts), "hold_steps": self.hold,
                "last": None if last is None else {k: round(v, 6) if isinstance(v, float) else v
                                                   for k, v in last.items()}}
