"""Which expert shards an actor keeps in its device tier when they do not all fit (README: Offload). Pure: no
tensors, no threads, the clock passed in, so it is tested with a fake clock (tests/unit/test_residency_policy.py).

The order of eviction is LRU with two exceptions:
- a pinned shard (one the call in progress computes with, or one being loaded) is never evicted;
- a shard that is hot over the load window (used more often within `window_s` than the average candidate) goes
  only after every cold one. So a skewed load keeps its hot experts resident while the cold ones take turns; under
  an even load (e.g. decode cycling through the layers) no shard is above the average and the order is plain LRU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

Shard = tuple[int, int]  # (layer, expert)


@dataclass
class ResidencyPolicy:
    budget_bytes: int
    window_s: float = 30.0
    last_used: dict[Shard, float] = field(default_factory=dict)
    uses: dict[Shard, deque] = field(default_factory=dict)  # shard -> times it was used within the window

    def __post_init__(self) -> None:
        assert self.budget_bytes >= 0 and self.window_s > 0, (self.budget_bytes, self.window_s)

    def record_use(self, shards: Iterable[Shard], now: float) -> None:
        """A call computed with these shards at `now`."""
        for shard in shards:
            self.last_used[shard] = now
            times = self.uses.setdefault(shard, deque())
            times.append(now)
            self._expire(times, now)

    def forget(self, shard: Shard) -> None:
        """The shard left the device tier: its recency goes with it (its window uses stay, they are load history)."""
        self.last_used.pop(shard, None)

    def uses_in_window(self, shard: Shard, now: float) -> int:
        times = self.uses.get(shard)
        if not times:
            return 0
        self._expire(times, now)
        return len(times)

    def eviction_order(self, candidates: Iterable[Shard], now: float) -> list[Shard]:
        """candidates (unpinned resident shards) in the order they should leave: cold before hot, then least
        recently used first (a shard never used, e.g. preloaded, counts as oldest); ties by shard id, so the order
        is deterministic."""
        shards = list(candidates)
        if not shards:
            return []
        counts = {s: self.uses_in_window(s, now) for s in shards}
        mean = sum(counts.values()) / len(shards)
        return sorted(shards, key=lambda s: (counts[s] > mean, self.last_used.get(s, float("-inf")), s))

    def victims(self, resident: Mapping[Shard, int], need: int, pinned: Collection[Shard],
                now: float) -> list[Shard] | None:
        """Shards to evict so that `need` more bytes fit in the budget.

        resident: shard -> bytes of every shard that holds device memory (loading ones included); pinned: shards
        that must stay. -> [] when it fits already, the shortest prefix of the eviction order that makes room, or
        None when even evicting every unpinned shard would not (the caller decides: skip a prefetch, or load a
        shard the call needs over the budget)."""
        free = self.budget_bytes - sum(resident.values())
        if need <= free:
            return []
        out: list[Shard] = []
        for shard in self.eviction_order((s for s in resident if s not in pinned), now):
            out.append(shard)
            free += resident[shard]
            if need <= free:
                return out
        return None

    def _expire(self, times: deque, now: float) -> None:
        while times and times[0] <= now - self.window_s:
            times.popleft()
