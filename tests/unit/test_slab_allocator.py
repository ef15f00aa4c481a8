"""The first-fit slab allocator behind the `rdt` transport's registered read buffers (experts/slab_allocator.py)."""

from __future__ import annotations

import random

import pytest

from expertmesh.experts.slab_allocator import ALIGN, SlabAllocator


def test_ranges_are_aligned_and_do_not_overlap():
    slab = SlabAllocator(10 * ALIGN)
    a, b, c = slab.take(1), slab.take(ALIGN + 1), slab.take(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    assert slab.free_bytes == 6 * ALIGN and slab.taken == 3


def test_a_range_that_does_not_fit_is_refused_not_split():
    slab = SlabAllocator(4 * ALIGN)
    first = slab.take(2 * ALIGN)
    slab.take(ALIGN)
    assert slab.take(2 * ALIGN) is None  # one range of ALIGN is left
    slab.give_back(first)
    assert slab.take(2 * ALIGN) == first


def test_given_back_ranges_merge_with_both_neighbours():
    slab = SlabAllocator(3 * ALIGN)
    a, b, c = (slab.take(ALIGN) for _ in range(3))
    slab.give_back(a)
    slab.give_back(c)
    slab.give_back(b)  # joins a and c: the whole slab is one range again
    assert slab.take(3 * ALIGN) == 0


def test_a_retired_range_is_never_handed_out_again():
    slab = SlabAllocator(2 * ALIGN)
    a = slab.take(ALIGN)
    slab.retire(a)
    assert slab.retired_bytes == ALIGN and slab.taken == 0
    assert slab.take(ALIGN) == ALIGN
    assert slab.take(ALIGN) is None


def test_giving_back_an_unknown_offset_raises():
    slab = SlabAllocator(ALIGN)
    with pytest.raises(KeyError):
        slab.give_back(0)


@pytest.mark.parametrize("bad", [0, -1])
def test_sizes_must_be_positive(bad):
    with pytest.raises(ValueError, match="positive"):
        SlabAllocator(bad)
    with pytest.raises(ValueError, match="nbytes"):
        SlabAllocator(ALIGN).take(bad)


def test_random_takes_and_give_backs_keep_the_books_balanced():
    rng = random.Random(7)
    capacity = 64 * ALIGN
    slab = SlabAllocator(capacity)
    held: dict[int, int] = {}
    for _ in range(2000):
        if held and rng.random() < 0.5:
            offset = rng.choice(list(held))
            slab.give_back(offset)
            del held[offset]
        else:
            nbytes = rng.randint(1, 8 * ALIGN)
            offset = slab.take(nbytes)
            if offset is None:
                continue
            size = -(-nbytes // ALIGN) * ALIGN
            assert offset % ALIGN == 0 and offset + size <= capacity
            assert all(offset + size <= o or o + s <= offset for o, s in held.items())  # no overlap
            held[offset] = size
        assert slab.free_bytes + sum(held.values()) == capacity
    for offset in list(held):
        slab.give_back(offset)
    assert slab.take(capacity) == 0
