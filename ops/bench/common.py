"""What every benchmark shares: the machine a result was measured on, timing (best-of, medians, alternating A/B
rounds) and the JSON report. Synthetic checkpoints are in checkpoints.py.

Timing conventions, so results compare across benchmarks:
  best_ms    the fastest of n runs after a warm-up: on a shared machine the minimum is the code's own cost, the
             median mostly the neighbours'. For micro-benchmarks of one code path.
  median_ms  the median of measured runs: for a whole forward or a served round, where the spread is part of it.
  alternate  A and B measured in alternating rounds (optionally swapping who goes first), so background load on a
             shared box falls on both alike.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch


def machine_info(**extra) -> dict:
    """{"cpus", "platform", "torch"} plus `extra` (e.g. torch_threads=..., python=...), as every result records it."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__, **extra}


def all_cores() -> int:
    """Use every core for torch (a benchmark that compares against `transformers` gives both the whole box)."""
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    return cores


def best_ms(fn: Callable[[], object], repeats: int, *, warmup: int = 1, setup: Callable[[], object] | None = None,
            digits: int = 3) -> float:
    """The fastest of `repeats` runs of fn after `warmup` untimed ones, in ms. setup (untimed) runs before each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(1000 * min(times), digits)


def median_ms(seconds: Sequence[float], digits: int = 3) -> float:
    """The median of timings given in seconds, in ms."""
    return round(1000 * statistics.median(seconds), digits)


def alternate(rounds: int, names: Sequence[str], swap: bool = False) -> Iterator[tuple[int, str]]:
    """(round, name) for `rounds` rounds of every name in turn; swap: reverse the order every other round, so
    neither side always runs first (right after the other's warm caches or its garbage)."""
    for r in range(rounds):
        order = list(names)[::-1] if swap and r % 2 else list(names)
        for name in order:
            yield r, name


def say_to_stderr(verbose: bool) -> Callable[[str], None]:
    """A progress printer (stderr, so stdout stays the JSON result) that is silent when not verbose."""
    def say(msg: str) -> None:
        if verbose:
            print(msg, file=sys.stderr, flush=True)
    return say


def report_text(result: dict, indent: int | None = 2) -> str:
    return json.dumps(result, indent=indent)


def write_report(result: dict, out: str | Path | None = None, *, echo: bool = True, indent: int | None = 2) -> str:
    """Print the result as JSON (echo) and also write it to `out` (with a trailing newline) when given."""
    text = report_text(result, indent)
    if echo:
        print(text)
    if out:
        Path(out).write_text(text + "\n")
    return text
