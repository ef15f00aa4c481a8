"""Which KV-cache blocks are free, shared or cached: a pure allocator over block ids 0..num_blocks-1 (no tensors).

The paged KV cache (experts/kv_cache.py) stores tokens in fixed-size blocks; a sequence owns a list of block ids (its
block table) in any order, so freed blocks are reused by whoever asks next and there is no external fragmentation:
any `n` free blocks serve a request for `n`, wherever they lie. The only waste is the unused tail of a sequence's
last block (internal fragmentation, < block_size tokens per sequence).

Prefix caching (README: Prefix caching; the keys are experts/prefix_cache.py's hash chain): a full block whose
content is final can be `register`ed under its key. Several sequences may then hold it at once (a reference count per
block; `match` finds the blocks of a key chain, `share` takes a reference). When the last holder frees a registered
block it is not wiped: it stays cached, free for anyone but still findable, in an LRU list, and is evicted (its key
forgotten, its content overwritten) only when `allocate` finds no never-cached free block. So `num_free` counts
cached free blocks too: they cost nothing to take back.

Fresh blocks are handed out lowest id first (a heap), so a fresh pool gives a sequence contiguous blocks and tests
can predict ids; when the heap is empty the least recently freed cached block goes first.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from collections.abc import Hashable


class OutOfBlocks(RuntimeError):
    """Fewer free blocks than asked for; nothing was allocated."""

    def __init__(self, wanted: int, free: int):
        super().__init__(f"asked for {wanted} KV-cache blocks, {free} free")
        self.wanted, self.free = wanted, free


class BlockAllocator:
    def __init__(self, num_blocks: int):
        assert num_blocks >= 1, num_blocks
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap of free ids that hold nothing cached
        self._refs: dict[int, int] = {}  # block in use -> holders (> 0)
        self._key_of: dict[int, Hashable] = {}  # registered block (in use or cached-free) -> its key
        self._block_of: dict[Hashable, int] = {}  # key -> the block holding it
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached free blocks, least recently freed first
        self.evictions = 0  # cached blocks whose content was dropped to make room
        # A cache dropped without free() is released by its finalizer, on whichever thread collects it.
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: never-cached free ones plus cached free ones (evicted on demand)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Registered blocks (held or cached-free): what a prefix lookup can find."""
        return len(self._key_of)

    @property
    def num_cached_free(self) -> int:
        return len(self._lru)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n blocks no one holds, all or none (OutOfBlocks); cached free blocks are evicted (LRU) when the never-cached
        ones run out."""
        assert n >= 0, n
        with self._lock:
            if n > self.num_free:
                raise OutOfBlocks(n, self.num_free)
            ids = []
            for _ in range(n):
                if self._free:
                    b = heapq.heappop(self._free)
                else:
                    b, _ = self._lru.popitem(last=False)
                    del self._block_of[self._key_of.pop(b)]
                    self.evictions += 1
                self._refs[b] = 1
                ids.append(b)
        return ids

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; freeing a block that is not in use is a bug (double free) and raises.
        A block nobody holds any more goes back to the heap, or, when registered, to the cached LRU list: `ids` in
        block-table order, so a chain's last blocks are queued to be evicted before its first ones (a later block
        is useless without the ones before it)."""
        with self._lock:
            for b in ids:
                if b not in self._refs:
                    raise ValueError(f"block {b} is not allocated (double free?)")
            for b in reversed(ids):
                self._refs[b] -= 1
                if self._refs[b]:
                    continue
                del self._refs[b]
                if b in self._key_of:
                    self._lru[b] = None
                else:
                    heapq.heappush(self._free, b)

    # ---- prefix caching --------------------------------------------------------------------------------------

    def register(self, block: int, key: Hashable) -> bool:
        """Make a held, full block findable under `key`. False (nothing changes) when another block already holds
        `key` (two sequences computed the same block at once: the first one stays the shared copy) or this block
        is registered already."""
        with self._lock:
            if block not in self._refs:
                raise ValueError(f"block {block} is not allocated: only a held block can be registered")
            if key in self._block_of or block in self._key_of:
                return False
            self._block_of[key] = block
            self._key_of[block] = key
            return True

    def match(self, keys: list[Hashable]) -> list[int]:
        """The blocks holding the longest run of `keys` from the first (stops at the first key not cached). Takes
        no reference: `share` the result before anything else allocates."""
        with self._lock:
            out = []
            for key in keys:
                b = self._block_of.get(key)
                if b is None:
                    break
                out.append(b)
            return out

    def free_among(self, blocks: list[int]) -> int:
        """How many of `blocks` are cached free (sharing them takes them out of num_free)."""
        with self._lock:
            return sum(b in self._lru for b in blocks)

    def share(self, blocks: list[int]) -> None:
        """Take one reference to each of `blocks` (registered ones, from `match`), taking cached free ones out of the
        LRU list."""
        with self._lock:
            for b in blocks:
                if b not in self._key_of:
                    raise ValueError(f"block {b} is not cached: only a registered block can be shared")
            for b in blocks:
                if b in self._refs:
                    self._refs[b] += 1
                else:
                    del self._lru[b]
                    self._refs[b] = 1

    def refs(self, block: int) -> int:
        """Holders of `block` (0: free)."""
        return self._refs.get(block, 0)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens."""
    return -(-tokens // block_size)
