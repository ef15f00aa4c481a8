"""An expert actor's memory tiers (README: Offload): the shards it hosts, of which only a device budget's worth is
resident at a time; the rest wait in a lower tier and are brought in when a call needs them (on demand) or when the
router predicts the next layer will (prefetch, loaded by a background thread while the actor computes).

Lower tiers (anything with `fetch(shard) -> weights on the device` and a `name`):
- `HostTier`: every shard's weights in host memory (pinned on CUDA), copied to the GPU on demand;
- `DiskTier`: the memory-mapped safetensors checkpoint, read (and cast to the serving dtype) on demand. On a CPU-only
  machine this is the lower tier: the "device" tier is then the in-RAM working set, so the mechanism runs and is
  measured there too.

Weights are any object with `.to(device)` and `.nbytes()` (GatedMLPWeights, or quantised weights): the store only
moves and counts them. Which shard leaves is experts/residency_policy.py's decision; this module does the moving,
the locking and the counting. No Ray here (the actor wraps it), so it is tested in process.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from .eviction import make_eviction_order
from .residency_policy import ResidencyPolicy
from .weights import load_expert_shards

Shard = tuple[int, int]  # (layer, expert)
GIB = 1 << 30


class DiskTier:
    """Shards read from the checkpoint on demand (safetensors maps the file; a read copies the shard's bytes out of
    the mapping, cast once to `dtype`, onto `device`), exactly as the all-resident actor loads them, so the weights
    are bit-identical. quant: experts.quant, applied as each shard is read (as the all-resident load does)."""

    name = "disk"

    def __init__(self, reader, dtype: torch.dtype, device: torch.device, quant: str = "none"):
        self.reader, self.dtype, self.device, self.quant = reader, dtype, device, quant

    def fetch(self, shard: Shard):
        return load_expert_shards(self.reader, [shard], self.dtype, self.device, quant=self.quant)[shard]


class HostTier:
    """Every shard held in host memory (pinned where CUDA is, so copies to the GPU are DMA), moved with
    `.to(device)`. Only meaningful for a GPU device: on a CPU `.to("cpu")` is the same tensors.

    On CUDA the copy runs on a stream of its own. A plain `.to(device)` from the loader thread goes on the legacy
    default stream, the one the actor's expert kernels run on, so a prefetch would queue between them instead of
    overlapping them. The loader thread waits for its own copy (an event), never the compute stream, and each new
    tensor is recorded on the compute stream, so the caching allocator does not hand its memory to the next copy
    while kernels queued before its eviction may still read it."""

    name = "host"

    def __init__(self, host_weights: dict[Shard, object], device: torch.device):
        self.host = host_weights
        self.device = torch.device(device)
        self._copy_stream = None  # made on first use, on the loading thread's device context

    def fetch(self, shard: Shard):
        weights = self.host[shard]
        if self.device.type != "cuda":
            return weights.to(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            out = weights.to(self.device, non_blocking=True)  # pinned source: a DMA on the copy stream
        self._copy_stream.record_event().synchronize()  # this thread waits for its copy, the kernels do not
        compute = torch.cuda.default_stream(self.device)
        for t in _tensors(out):
            t.record_stream(compute)
        return out


def _tensors(weights) -> list[torch.Tensor]:
    """Every tensor a shard's weights hold (a dataclass of tensors, possibly of quantised matrices)."""
    if isinstance(weights, torch.Tensor):
        return [weights]
    if not dataclasses.is_dataclass(weights):
        return []
    return [t for f in dataclasses.fields(weights) for t in _tensors(getattr(weights, f.name))]


def pinned_copy(weights):
    """A shard's host copy in page-locked memory, so its copy to the GPU is a DMA that can overlap compute."""
    if not dataclasses.is_dataclass(weights):
        return weights  # another weights type (e.g. quantised) keeps its own host layout
    return dataclasses.replace(weights, **{f.name: getattr(weights, f.name).pin_memory()
                                           for f in dataclasses.fields(weights)
                                           if isinstance(getattr(weights, f.name), torch.Tensor)})


class TierStore:
    """The device tier of one actor: `acquire` a call's shards (pinned until `release`), `prefetch` hints.

    Counters (`stats()`): hits / misses (shards a call found resident / had to wait for), bytes_moved (lower tier ->
    device), stall_s (time calls waited on loads), prefetch_issued / prefetch_useful (prefetched shards later used
    by a call, whether the load had finished or not), prefetch_dropped (the budget holds no second shard; a hint
    that finds the budget full of pinned shards waits for the call to release them instead), prefetch_deferred (hints
    that waited for a release because the order's first victim was pinned),
    evictions, over_budget (a call needed more than the budget: loaded anyway, evicted after)."""

    def __init__(self, shards: list[Shard], lower, budget_bytes: int, window_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, eviction: str = "layer-cycle"):
        self.shards = sorted(shards)
        self.lower = lower
        self.budget_bytes = int(budget_bytes)
        self.clock = clock
        # eviction: experts.eviction's order (experts/eviction.py); arc's capacity is set once a shard's size is known
        order = make_eviction_order(eviction, layers={layer for layer, _ in self.shards}, window_s=window_s)
        self.policy = ResidencyPolicy(self.budget_bytes, window_s, order)
        self._lock = threading.Lock()
        self._resident: dict[Shard, object] = {}
        self._bytes: dict[Shard, int] = {}  # device bytes of resident and loading shards
        self._loading: dict[Shard, Future] = {}
        self._pins: dict[Shard, int] = {}
        self._shard_bytes = 0  # the largest shard seen: the reservation for one not loaded yet
        self._prefetched: set[Shard] = set()  # loaded (or loading) by prefetch, not yet used by a call
        self._queue: list[Shard] = []  # prefetch hints not started yet (a newer hint replaces them)
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.hits = self.misses = self.bytes_moved = 0
        self.stall_s = 0.0
        self.prefetch_issued = self.prefetch_useful = self.prefetch_dropped = self.prefetch_deferred = 0
        self.evictions = self.over_budget = 0

    # ---- start-up ------------------------------------------------------------------------------------------

    def preload(self, on_bytes: Callable[[int], None] | None = None) -> None:
        """Fill the budget with shards in (layer, expert) order before the actor serves (not counted as moves)."""
        for shard in self.shards:
            if self._shard_bytes and self.resident_bytes() + self._shard_bytes > self.budget_bytes:
                break
            weights = self.lower.fetch(shard)
            size = int(weights.nbytes())
            if self.resident_bytes() + size > self.budget_bytes and self._resident:
                break  # the first shard always loads, so its size is known
            with self._lock:
                self._resident[shard] = weights
                self._bytes[shard] = size
                self._note_shard_size(size)
                self.policy.admit(shard, self.clock())
            if on_bytes is not None:
                on_bytes(size)

    # ---- a call ----------------------------------------------------------------------------------------------

    def acquire(self, layer: int, experts: list[int]) -> list:
        """The weights of (layer, e) for e in experts, each resident and pinned until `release(layer, experts)`.
        Missing shards are loaded here (or waited for, when a prefetch is loading them)."""
        wanted = list(dict.fromkeys((layer, int(e)) for e in experts))
        to_load: list[tuple[Shard, Future]] = []
        waits: list[Future] = []
        with self._lock:
            now = self.clock()
            for shard in wanted:
                self._pins[shard] = self._pins.get(shard, 0) + 1
            self.policy.record_use(wanted, now)
            for shard in wanted:
                if shard in self._prefetched:
                    self._prefetched.discard(shard)
                    self.prefetch_useful += 1
                if shard in self._resident:
                    self.hits += 1
                    continue
                self.misses += 1
                if shard in self._queue:
                    self._queue.remove(shard)  # the call loads it now rather than after the hints before it
                if shard in self._loading:
                    waits.append(self._loading[shard])
                    continue
                self._make_room(self._shard_bytes, demand=True)
                future: Future = Future()
                self._loading[shard] = future
                self._bytes[shard] = self._shard_bytes
                to_load.append((shard, future))
        if to_load or waits:
            started = time.perf_counter()
            try:
                for shard, future in to_load:
                    self._load(shard, future)
                for future in waits:
                    future.result()
            except BaseException as exc:
                with self._lock:  # loads this call never started: whoever waits on them fails too
                    for shard, future in to_load:
                        if not future.done():
                            self._loading.pop(shard, None)
                            self._bytes.pop(shard, None)
                            future.set_exception(exc)
                self.release(layer, experts)  # the call fails; its pins must not outlive it
                raise
            finally:
                with self._lock:
                    self.stall_s += time.perf_counter() - started
        with self._lock:
            return [self._resident[(layer, int(e))] for e in experts]

    def release(self, layer: int, experts: list[int]) -> None:
        with self._lock:
            for shard in dict.fromkeys((layer, int(e)) for e in experts):
                left = self._pins.get(shard, 0) - 1
                if left > 0:
                    self._pins[shard] = left
                else:
                    self._pins.pop(shard, None)
            if self._held_bytes() > self.budget_bytes:
                self._make_room(0, demand=False)  # give back what an over-budget call took
            if self._queue:
                self._wake.notify()  # a hint waiting for room may fit now

    # ---- prefetch ---------------------------------------------------------------------------------------------

    def prefetch(self, shards: list[Shard]) -> None:
        """Start loading these shards in the background (the ones this actor hosts and lacks). A newer hint replaces
        hints not started yet: they were for a layer that has run by now."""
        hosted = set(self.shards)
        with self._lock:
            self._queue = [s for s in dict.fromkeys(map(tuple, shards))
                           if s in hosted and s not in self._resident and s not in self._loading]
            if self._queue:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._prefetch_loop, name="expert-prefetch", daemon=True)
                    self._thread.start()
                self._wake.notify()

    def _prefetch_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                shard = self._queue.pop(0)
                if shard in self._resident or shard in self._loading:
                    continue
                if self._best_victim_is_pinned():
                    # The order would evict a shard a call still computes with (layer-cycle: the current layer's,
                    # the one needed last). Evicting the next-best instead would throw away a shard that would
                    # have hit (at 2 of 4 slots: a third more loads than on demand, measured); wait for the release.
                    self.prefetch_deferred += 1
                    self._queue.insert(0, shard)
                    self._wake.wait()
                    continue
                if not self._make_room(self._shard_bytes, demand=False):
                    if self._pins:
                        # Full of shards a call computes with: load this one as soon as a call releases them (a
                        # newer hint may replace it meanwhile), still ahead of the layer that needs it.
                        self._queue.insert(0, shard)
                        self._wake.wait()
                    else:
                        self.prefetch_dropped += 1  # the budget holds less than one more shard
                    continue
                future: Future = Future()
                self._loading[shard] = future
                self._bytes[shard] = self._shard_bytes
                self._prefetched.add(shard)
                self.prefetch_issued += 1
            try:
                self._load(shard, future)
            except Exception:  # a call waiting on it gets the error through the future; the thread goes on
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()

    # ---- internals -----------------------------------------------------------------------------------------

    def _load(self, shard: Shard, future: Future) -> None:
        """Fetch outside the lock (other calls and hints proceed meanwhile), then publish."""
        try:
            weights = self.lower.fetch(shard)
        except BaseException as exc:
            with self._lock:
                self._loading.pop(shard, None)
                self._bytes.pop(shard, None)
                self._prefetched.discard(shard)
            future.set_exception(exc)
            raise
        size = int(weights.nbytes())
        with self._lock:
            self._resident[shard] = weights
            self._bytes[shard] = size
            self._note_shard_size(size)
            self.policy.admit(shard, self.clock())
            self._loading.pop(shard, None)
            self.bytes_moved += size
        future.set_result(None)

    def _best_victim_is_pinned(self) -> bool:
        """Lock held: a load needs room, and the eviction order over every resident shard (pinned ones included)
        puts a pinned one first."""
        if self._held_bytes() + self._shard_bytes <= self.budget_bytes or not self._pins:
            return False
        order = self.policy.eviction_order([s for s in self._resident if s not in self._loading], self.clock())
        return bool(order) and order[0] in self._pins

    def _make_room(self, need: int, demand: bool) -> bool:
        """Evict (lock held) so `need` more bytes fit. A demand load goes ahead over the budget when pinned shards
        leave no room (counted); a prefetch does not (returns False)."""
        pinned = set(self._pins) | set(self._loading)
        victims = self.policy.victims(self._bytes, need, pinned, self.clock())
        if victims is None:
            if not demand:
                return False
            self.over_budget += 1
            victims = self.policy.eviction_order((s for s in self._resident if s not in pinned), self.clock())
        for shard in victims:
            self._resident.pop(shard, None)
            self._bytes.pop(shard, None)
            self._prefetched.discard(shard)
            self.policy.forget(shard)
            self.evictions += 1
        return True

    def _note_shard_size(self, size: int) -> None:  # lock held
        self._shard_bytes = max(self._shard_bytes, size)
        if hasattr(self.policy.order, "capacity"):  # arc: how many shards the budget holds
            self.policy.order.capacity = max(1, self.budget_bytes // self._shard_bytes)

    def resident_bytes(self) -> int:
        """Device bytes held now (resident and loading shards)."""
        with self._lock:
            return self._held_bytes()

    def _held_bytes(self) -> int:  # lock held
        return sum(self._bytes.values())

    def resident(self) -> list[Shard]:
        with self._lock:
            return sorted(self._resident)

    def weights(self, shard: Shard):
        """A resident shard's weights (None when not resident); no pin, no counting."""
        with self._lock:
            return self._resident.get(shard)

    def stats(self) -> dict:
        with self._lock:
            return {
                "tier": self.lower.name, "budget_bytes": self.budget_bytes, "resident_bytes": self._held_bytes(),
                "resident_shards": len(self._resident), "hosted_shards": len(self.shards),
                "hits": self.hits, "misses": self.misses, "bytes_moved": self.bytes_moved, "stall_s": self.stall_s,
                "prefetch_issued": self.prefetch_issued, "prefetch_useful": self.prefetch_useful,
                "prefetch_dropped": self.prefetch_dropped, "prefetch_deferred": self.prefetch_deferred,
                "evictions": self.evictions,
                "over_budget": self.over_budget,
            }
