"""The paged KV cache: the block allocator, the pool's sizing, and write/read through block tables."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.block_allocator import BlockAllocator, OutOfBlocks, blocks_for
from expertmesh.experts.kv_cache import KVCacheSettings, PagedKVPool

GQA = {"k": (2, 4), "v": (2, 4)}  # kvh 2, D 4
MLA = {"latent": (6,)}  # one latent per token, no heads


def test_allocator_allocates_frees_and_reuses():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert a == [0, 1, 2] and alloc.num_free == 1 and alloc.num_used == 3
    alloc.free([1])
    assert alloc.allocate(2) == [1, 3]  # the freed block is reused
    assert alloc.num_free == 0


def test_allocator_out_of_blocks_allocates_nothing():
    alloc = BlockAllocator(3)
    alloc.allocate(2)
    with pytest.raises(OutOfBlocks) as err:
        alloc.allocate(2)
    assert (err.value.wanted, err.value.free) == (2, 1)
    assert alloc.num_free == 1  # all or none
    assert not alloc.can_allocate(2) and alloc.can_allocate(1)


def test_allocator_refuses_a_double_free():
    alloc = BlockAllocator(2)
    ids = alloc.allocate(1)
    alloc.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(ids)


def test_fragmented_free_blocks_still_serve_a_large_request():
    """Blocks freed here and there (every other one) serve one sequence: no external fragmentation."""
    alloc = BlockAllocator(8)
    ids = alloc.allocate(8)
    alloc.free(ids[::2])  # 0, 2, 4, 6 free: no two adjacent
    assert alloc.allocate(4) == [0, 2, 4, 6]


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_bytes_per_token_is_the_gqa_formula():
    layers, kvh, d = 3, 2, 4
    for dtype, item in ((torch.float32, 4), (torch.bfloat16, 2)):
        assert PagedKVPool.bytes_per_token([GQA] * layers, dtype) == layers * 2 * kvh * d * item
    assert PagedKVPool.bytes_per_token([MLA] * 2, torch.float32) == 2 * 6 * 4


def test_plan_honours_the_budget_and_the_token_cap():
    per_token = PagedKVPool.bytes_per_token([GQA] * 2, torch.float32)  # 128
    pool = PagedKVPool.plan([GQA] * 2, torch.float32, "cpu", context=64,
                            settings=KVCacheSettings(block_size=4, budget_bytes=per_token * 4 * 10))
    assert pool.num_blocks == 10 and pool.capacity_tokens == 40
    assert pool.nbytes() == 10 * 4 * per_token  # the budget, to the byte
    capped = PagedKVPool.plan([GQA] * 2, torch.float32, "cpu", context=64,
                              settings=KVCacheSettings(block_size=4, budget_bytes=1 << 30, max_tokens=18))
    assert capped.num_blocks == 5  # 18 tokens need 5 blocks of 4


def _history(layers: int, spec: dict, length: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{name: torch.randn((length, *shape), generator=g) for name, shape in spec.items()} for _ in range(layers)]


@pytest.mark.parametrize("spec", [GQA, MLA], ids=["gqa", "mla"])
def test_paged_write_then_read_equals_the_concatenated_history(spec):
    """Two sequences written in interleaved steps of uneven sizes (so their blocks interleave in the pool) read
    back exactly their own histories, via `read` and via one batched `gather` + lengths."""
    layers, bs = 2, 4
    pool = PagedKVPool([spec] * layers, num_blocks=16, block_size=bs, dtype=torch.float32)
    a, b = pool.new_sequence(), pool.new_sequence()
    ha, hb = _history(layers, spec, 11, seed=1), _history(layers, spec, 7, seed=2)
    for na, nb in ((3, 5), (1, 1), (6, 0), (1, 1)):
        step = [(c, n, h) for c, n, h in ((a, na, ha), (b, nb, hb)) if n]
        caches, lengths = [c for c, _, _ in step], [n for _, n, _ in step]
        for c, n in zip(caches, lengths):
            c.reserve(n)
        slots = pool.slots(caches, lengths)
        for layer in range(layers):
            pool.write(layer, slots, {name: torch.cat([h[layer][name][c.length:c.length + n] for c, n, h in step])
                                      for name in spec})
        for c, n in zip(caches, lengths):
            c.length += n
    assert (a.length, b.length) == (11, 7)
    assert set(a.blocks).isdisjoint(b.blocks) and a.blocks != sorted(a.blocks + b.blocks)[:3]  # interleaved
    table, lengths = pool.block_table([a, b], [a.length, b.length])
    assert table.shape == (2, 3) and lengths.tolist() == [11, 7]
    for layer in range(layers):
        got = pool.gather(layer, table)
        for name in spec:
            assert torch.equal(a.read(layer)[name], ha[layer][name])
            assert torch.equal(b.read(layer)[name], hb[layer][name])
            assert torch.equal(got[name][0, :11], ha[layer][name])
            assert torch.equal(got[name][1, :7], hb[layer][name])
            assert torch.isfinite(got[name]).all()  # padding is zeroed or stale data, never NaN


def test_free_returns_blocks_for_reuse_and_new_blocks_are_zeroed():
    pool = PagedKVPool([GQA], num_blocks=2, block_size=4, dtype=torch.float32)
    a = pool.new_sequence()
    a.reserve(8)
    pool.write(0, pool.slots([a], [8]), {"k": torch.full((8, 2, 4), 7.0), "v": torch.full((8, 2, 4), 7.0)})
    assert a.nbytes() == 2 * pool.block_bytes and pool.allocator.num_free == 0
    b = pool.new_sequence()
    with pytest.raises(OutOfBlocks):
        b.reserve(1)
    a.free()
    assert a.length == 0 and a.blocks == [] and pool.allocator.num_free == 2
    b.reserve(5)
    assert sorted(b.blocks) == [0, 1]
    assert all(torch.count_nonzero(t) == 0 for t in pool.storage[0].values())  # a's 7s are gone


def test_reserve_allocates_only_what_the_new_tokens_need():
    pool = PagedKVPool([GQA], num_blocks=8, block_size=4, dtype=torch.float32)
    c = pool.new_sequence()
    assert c.blocks_needed(4) == 1 and c.blocks_needed(5) == 2
    c.reserve(3)
    c.length = 3
    assert c.blocks_needed(1) == 0 and c.blocks_needed(2) == 1
    c.reserve(1)
    assert len(c.blocks) == 1
