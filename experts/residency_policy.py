"""Which expert shards an actor keeps in its device tier when they do not all fit (README: Offload). Pure: no
tensors, no threads, the clock passed in, so it is tested with a fake clock (tests/unit/test_residency_policy.py).

This module does the budget arithmetic (how many bytes must leave, never a pinned shard: one the call in progress
computes with, or one being loaded); the order in which candidates leave is an `EvictionOrder`
(experts/eviction.py, `experts.eviction`: lru, lfru, arc, layer-cycle). Without one, lfru: LRU, except that a shard
used more often within `window_s` than the average candidate goes only after every colder one.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from .eviction import EvictionOrder, LFRUOrder

Shard = tuple[int, int]  # (layer, expert)


@dataclass
class ResidencyPolicy:
    budget_bytes: int
    window_s: float = 30.0
    order: EvictionOrder | None = None  # None: LFRUOrder(window_s)
    uses_seen: int = field(default=0)

    def __post_init__(self) -> None:
        assert self.budget_bytes >= 0 and self.window_s > 0, (self.budget_bytes, self.window_s)
        if self.order is None:
            self.order = LFRUOrder(self.window_s)

    def record_use(self, shards: Iterable[Shard], now: float) -> None:
        """A call computed with these shards at `now`."""
        shards = list(shards)
        self.uses_seen += len(shards)
        self.order.on_use(shards, now)

    def admit(self, shard: Shard, now: float) -> None:
        """The shard became resident (loaded on demand, by prefetch, or preloaded)."""
        self.order.on_admit(shard, now)

    def forget(self, shard: Shard) -> None:
        """The shard left the device tier."""
        self.order.on_evict(shard)

    def uses_in_window(self, shard: Shard, now: float) -> int:
        """Uses within the window (lfru only; other orders keep no window)."""
        return self.order.uses_in_window(shard, now) if isinstance(self.order, LFRUOrder) else 0

    def eviction_order(self, candidates: Iterable[Shard], now: float) -> list[Shard]:
        """candidates (unpinned resident shards) in the order they should leave; deterministic (ties by shard id)."""
        return self.order.order(list(candidates), now)

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
