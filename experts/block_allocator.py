"""Which KV-cache blocks are free: a pure allocator over block ids 0..num_blocks-1 (no tensors).

The paged KV cache (experts/kv_cache.py) stores tokens in fixed-size blocks; a sequence owns a list of block ids (its
block table) in any order, so freed blocks are reused by whoever asks next and there is no external fragmentation:
any `n` free blocks serve a request for `n`, wherever they lie. The only waste is the unused tail of a sequence's
last block (internal fragmentation, < block_size tokens per sequence).

Blocks are handed out lowest id first (a heap), so a fresh pool gives a sequence contiguous blocks and tests can
predict ids.
"""

from __future__ import annotations

import heapq
import threading


class OutOfBlocks(RuntimeError):
    """Fewer free blocks than asked for; nothing was allocated."""

    def __init__(self, wanted: int, free: int):
        super().__init__(f"asked for {wanted} KV-cache blocks, {free} free")
        self.wanted, self.free = wanted, free


class BlockAllocator:
    def __init__(self, num_blocks: int):
        assert num_blocks >= 1, num_blocks
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap of free ids
        self._used: set[int] = set()
        # A cache dropped without free() is released by its finalizer, on whichever thread collects it.
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n block ids, all or none (OutOfBlocks)."""
        assert n >= 0, n
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(n, len(self._free))
            ids = [heapq.heappop(self._free) for _ in range(n)]
            self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        """Give blocks back; freeing a block that is not in use is a bug (double free) and raises."""
        with self._lock:
            for b in ids:
                if b not in self._used:
                    raise ValueError(f"block {b} is not allocated (double free?)")
                self._used.remove(b)
                heapq.heappush(self._free, b)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens."""
    return -(-tokens // block_size)
