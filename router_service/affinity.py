"""Expert-affinity admission (README: Offload, issue 29 item 2): when decode slots free up, admit the waiting
requests whose predicted experts overlap most with what the running batch already uses, so a step touches fewer
distinct shards and an offloaded actor loads fewer; no request waits past `max_wait_s` (those go first, oldest
first, whatever their experts). Pure: sets and numbers, no torch, no Ray; tested in tests/unit/test_affinity.py and
replayed on the recorded routing trace by router_service/affinity_sim.py.

A request's signature is the set of experts predicted for it (e.g. the experts its prompt's tokens picked at the first
MoE layer, or its routing history); the batch's is the union of its running requests'. A candidate's cost is how
many experts it would add to the batch's set; ties go to the longer wait, then the lower id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Waiting:
    request_id: int
    arrived: float
    experts: frozenset[int]  # the predicted signature


def signature(expert_rows: Iterable[Iterable[int]], keep: int | None = None) -> frozenset[int]:
    """A prompt's signature from its tokens' picked experts (rows of top-k ids, negative: dropped): the experts
    picked, the `keep` most frequent when given (ties: lower id)."""
    counts: dict[int, int] = {}
    for row in expert_rows:
        for e in row:
            if e >= 0:
                counts[int(e)] = counts.get(int(e), 0) + 1
    ranked = sorted(counts, key=lambda e: (-counts[e], e))
    return frozenset(ranked if keep is None else ranked[:keep])


def admit(waiting: Iterable[Waiting], running: Mapping[int, frozenset[int]], free: int, now: float,
          max_wait_s: float) -> list[int]:
    """The request ids to admit into `free` slots, in admission order: first every request waiting ≥ max_wait_s
    (oldest first), then greedily the one adding the fewest experts to the batch's set (updated as each is
    admitted). running: request id -> signature of the requests in the batch."""
    assert free >= 0 and max_wait_s >= 0, (free, max_wait_s)
    pool = sorted(waiting, key=lambda w: (w.arrived, w.request_id))
    batch: set[int] = set().union(*running.values()) if running else set()
    chosen: list[int] = []
    overdue = [w for w in pool if now - w.arrived >= max_wait_s]
    for w in overdue[:free]:
        chosen.append(w.request_id)
        batch |= w.experts
    rest = [w for w in pool if w.request_id not in set(chosen)]
    while len(chosen) < free and rest:
        best = min(rest, key=lambda w: (len(w.experts - batch), w.arrived, w.request_id))
        rest.remove(best)
        chosen.append(best.request_id)
        batch |= best.experts
    return chosen


def admit_fifo(waiting: Iterable[Waiting], free: int) -> list[int]:
    """The baseline: oldest first."""
    return [w.request_id for w in sorted(waiting, key=lambda w: (w.arrived, w.request_id))[:free]]
