"""Orders in which an expert actor's device tier gives shards back when it needs room (README: Offload;
`experts.eviction`). Pure: no tensors, no threads, the clock passed in; tested in tests/unit/test_eviction.py and
compared on a recorded routing trace by experts/eviction_sim.py.

One interface (`EvictionOrder`): the tier tells the order which shards calls used (`on_use`), which shard became
resident (`on_admit`) and which left (`on_evict`); `order(candidates, now)` ranks the unpinned resident shards, first
to leave first. The budget arithmetic (how many must leave) is experts/residency_policy.py's; this module only ranks.

- "lru": least recently used first.
- "lfru": frequency class, then recency: a shard used more often within `window_s` than the average candidate goes
  only after every colder one; among equals, LRU. (The tier's order before `experts.eviction` existed.)
- "arc": Adaptive Replacement Cache (Megiddo & Modha, FAST '03) over shards: T1 = resident shards used once since
  they came in, T2 = used again; ghost lists B1/B2 remember recently evicted ones, and a hit on a ghost moves the
  target size p of T1 towards the list that would have kept it.
- "layer-cycle": the shard whose layer comes back last in the forward pass goes first. A decode step runs the MoE
  layers in order and every step again, so the next use of (layer, e) is (layer - current) mod L layers away: this
  is Belady's optimal order for that cycle (it keeps k-1 of an actor's L shards and rotates one slot, where LRU on a
  cycle longer than the budget misses every time). Ties (same layer) by recency.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Protocol

from .setting_choices import EVICTION_POLICIES

Shard = tuple[int, int]  # (layer, expert)


class EvictionOrder(Protocol):
    name: str

    def on_use(self, shards: Iterable[Shard], now: float) -> None: ...

    def on_admit(self, shard: Shard, now: float) -> None: ...

    def on_evict(self, shard: Shard) -> None: ...

    def order(self, candidates: Iterable[Shard], now: float) -> list[Shard]: ...


class LRUOrder:
    name = "lru"

    def __init__(self) -> None:
        self.last_used: dict[Shard, float] = {}
        self._tick = 0  # breaks ties between uses at the same clock reading in call order

    def on_use(self, shards: Iterable[Shard], now: float) -> None:
        for shard in shards:
            self._tick += 1
            self.last_used[shard] = (now, self._tick)

    def on_admit(self, shard: Shard, now: float) -> None:
        # A shard brought in (on demand, or ahead by prefetch) counts as used now: a prefetched shard that no call
        # has used yet is the newest, not the oldest (as oldest, the next hint evicted it before its layer ran).
        if shard not in self.last_used:
            self._tick += 1
            self.last_used[shard] = (now, self._tick)

    def on_evict(self, shard: Shard) -> None:
        self.last_used.pop(shard, None)

    def recency(self, shard: Shard) -> tuple:
        return self.last_used.get(shard, (float("-inf"), 0))

    def order(self, candidates: Iterable[Shard], now: float) -> list[Shard]:
        return sorted(candidates, key=lambda s: (self.recency(s), s))


class LFRUOrder(LRUOrder):
    name = "lfru"

    def __init__(self, window_s: float = 30.0) -> None:
        super().__init__()
        assert window_s > 0, window_s
        self.window_s = window_s
        self.uses: dict[Shard, deque] = {}  # shard -> times it was used within the window (kept across evictions)

    def on_use(self, shards: Iterable[Shard], now: float) -> None:
        shards = list(shards)
        super().on_use(shards, now)
        for shard in shards:
            times = self.uses.setdefault(shard, deque())
            times.append(now)
            self._expire(times, now)

    def uses_in_window(self, shard: Shard, now: float) -> int:
        times = self.uses.get(shard)
        if not times:
            return 0
        self._expire(times, now)
        return len(times)

    def order(self, candidates: Iterable[Shard], now: float) -> list[Shard]:
        shards = list(candidates)
        if not shards:
            return []
        counts = {s: self.uses_in_window(s, now) for s in shards}
        mean = sum(counts.values()) / len(shards)
        return sorted(shards, key=lambda s: (counts[s] > mean, self.recency(s), s))

    def _expire(self, times: deque, now: float) -> None:
        while times and times[0] <= now - self.window_s:
            times.popleft()


class ARCOrder:
    """capacity: shards the budget holds (the ghost lists' bound and p's range); the tier sets it from its budget
    and shard size, and may raise it later (`capacity` is a plain attribute)."""

    name = "arc"

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = max(1, int(capacity))
        self.p = 0.0  # target size of T1
        self.t1: OrderedDict[Shard, None] = OrderedDict()  # resident, one use since admitted; oldest first
        self.t2: OrderedDict[Shard, None] = OrderedDict()  # resident, used again
        self.b1: OrderedDict[Shard, None] = OrderedDict()  # ghosts evicted from T1
        self.b2: OrderedDict[Shard, None] = OrderedDict()  # ghosts evicted from T2

    def on_use(self, shards: Iterable[Shard], now: float) -> None:
        for shard in shards:
            if shard in self.t1:
                del self.t1[shard]
                self.t2[shard] = None
            elif shard in self.t2:
                self.t2.move_to_end(shard)
            # not resident: the tier loads it and calls on_admit, which applies the ghost adaptation

    def on_admit(self, shard: Shard, now: float) -> None:
        c = self.capacity
        if shard in self.b1:  # T1 was too small to keep it: grow p
            self.p = min(float(c), self.p + max(1.0, len(self.b2) / max(1, len(self.b1))))
            del self.b1[shard]
            self.t2[shard] = None
        elif shard in self.b2:  # T2 was too small: shrink p
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / max(1, len(self.b2))))
            del self.b2[shard]
            self.t2[shard] = None
        elif shard not in self.t1 and shard not in self.t2:
            self.t1[shard] = None

    def on_evict(self, shard: Shard) -> None:
        if shard in self.t1:
            del self.t1[shard]
            self.b1[shard] = None
        elif shard in self.t2:
            del self.t2[shard]
            self.b2[shard] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)

    def order(self, candidates: Iterable[Shard], now: float) -> list[Shard]:
        """ARC's REPLACE repeated without changing state: take T1's oldest while T1 holds more than p, else T2's."""
        wanted = set(candidates)
        t1 = [s for s in self.t1 if s in wanted]
        t2 = [s for s in self.t2 if s in wanted]
        unknown = sorted(wanted - set(t1) - set(t2))  # never seen by on_admit (e.g. loading): last resort
        out: list[Shard] = []
        n1 = len(self.t1)
        while t1 or t2:
            if t1 and (n1 > self.p or not t2):
                out.append(t1.pop(0))
                n1 -= 1
            else:
                out.append(t2.pop(0))
        return out + unknown


class LayerCycleOrder(LRUOrder):
    """layers: the MoE layers in forward order (the cycle). The current layer is the one of the latest use."""

    name = "layer-cycle"

    def __init__(self, layers: Iterable[int]) -> None:
        super().__init__()
        self.layers = sorted(set(layers))
        assert self.layers, "layer-cycle needs the MoE layers"
        self.position = {layer: i for i, layer in enumerate(self.layers)}
        self.current: int | None = None

    def on_use(self, shards: Iterable[Shard], now: float) -> None:
        shards = list(shards)
        super().on_use(shards, now)
        if shards:
            self.current = shards[-1][0]

    def distance(self, shard: Shard) -> int:
        """Layers until `shard`'s layer runs again, counted from the current one (its own layer: a full cycle)."""
        return layers_until(shard[0], self.current, self.layers)

    def order(self, candidates: Iterable[Shard], now: float) -> list[Shard]:
        return sorted(candidates, key=lambda s: (-self.distance(s), self.recency(s), s))


def layers_until(layer: int, current: int | None, layers: list[int]) -> int:
    """MoE layers from `current` until `layer` runs again (1: the next one; its own layer: a full cycle, len(layers));
    a full cycle when either is unknown. layers: sorted."""
    n = len(layers)
    if current is None or layer not in layers or current not in layers:
        return n
    return (layers.index(layer) - layers.index(current) - 1) % n + 1


def make_eviction_order(name: str, layers: Iterable[int] = (), capacity: int = 1,
                        window_s: float = 30.0) -> EvictionOrder:
    """The order named by `experts.eviction`. layers: the MoE layers (layer-cycle); capacity: shards the budget
    holds (arc)."""
    if name == "lru":
        return LRUOrder()
    if name == "lfru":
        return LFRUOrder(window_s)
    if name == "arc":
        return ARCOrder(capacity)
    if name == "layer-cycle":
        return LayerCycleOrder(layers)
    raise ValueError(f"eviction: must be one of {EVICTION_POLICIES}, got {name!r}")
