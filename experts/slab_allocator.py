"""First-fit byte ranges in one fixed slab: where the `rdt` transport's reads land (experts/rdt_box.py).

Why a slab at all: NIXL must register the memory a one-sided read writes into. Registering a fresh buffer per read
costs a registration (on a GPU, pinning device memory for the NIC: milliseconds) and, worse, its deregistration bumps
the process's NIXL metadata version, so every peer drops its connection to this process and loads its metadata again
before the next read (Ray 2.60 `nixl_tensor_transport.py`: `remove_remote_agent` on a version change). Measured
here with one actor and 1-row reads: every call paid a reconnect until both ends read into memory registered once.
A slab registered once and carved per read pays neither.

Pure bookkeeping: no torch, no Ray. Offsets are aligned to ALIGN bytes so any dtype's view of a range is aligned.
"""

from __future__ import annotations

ALIGN = 64  # a cache line; also covers every torch dtype's alignment


class SlabAllocator:
    """Byte ranges of a slab of `capacity` bytes, handed out first-fit and given back by offset.

    A range can be *retired* instead of given back: it is never handed out again. That is for a read that failed or
    timed out, whose transfer may still land later (a late write must not reach a range now holding other data)."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted by offset, never adjacent
        self._taken: dict[int, int] = {}  # offset -> size
        self.retired_bytes = 0

    def take(self, nbytes: int) -> int | None:
        """The offset of a free range of at least `nbytes` (rounded up to ALIGN), or None when none is free."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        size = -(-nbytes // ALIGN) * ALIGN
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self._taken[offset] = size
                return offset
        return None

    def give_back(self, offset: int) -> None:
        """Return a taken range; it merges with free neighbours."""
        size = self._taken.pop(offset)
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        free.insert(i, (offset, size))
        if i + 1 < len(free) and offset + size == free[i + 1][0]:  # merge with the next range
            free[i] = (offset, size + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # merge with the previous range
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

    def retire(self, offset: int) -> None:
        """Drop a taken range for good (see the class docstring)."""
        self.retired_bytes += self._taken.pop(offset)

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    @property
    def taken(self) -> int:
        """Ranges handed out and not yet given back or retired."""
        return len(self._taken)
