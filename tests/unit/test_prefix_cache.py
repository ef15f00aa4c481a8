"""Prefix caching, the pure parts: the blocks' hash chain (experts/prefix_cache.py), the allocator's reference
counts and LRU of cached free blocks (experts/block_allocator.py), and a sequence's lookup / adopt / commit over a
small pool (experts/kv_cache.py). No Ray, no model."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.block_allocator import BlockAllocator, OutOfBlocks
from expertmesh.experts.kv_cache import KVCacheSettings, PagedKVPool
from expertmesh.experts.prefix_cache import block_keys, reusable_blocks, root_key

ROOT = root_key("model-a", "torch.float32", 4)
GQA = [{"k": (1, 2), "v": (1, 2)}]


# ---- the hash chain ---------------------------------------------------------------------------------------------

def test_keys_cover_full_blocks_only_and_chain_on_the_prefix():
    keys = block_keys(list(range(10)), 4, ROOT)
    assert len(keys) == 2  # tokens 8, 9 are a partial block: no key
    assert keys == block_keys(list(range(8)), 4, ROOT)  # same tokens, same keys
    # Block 1's key depends on block 0: the same four tokens after a different first block get another key.
    other = block_keys([9, 9, 9, 9] + list(range(4, 8)), 4, ROOT)
    assert other[0] != keys[0] and other[1] != keys[1]
    # The same four tokens in another position (block 0 instead of block 1) get another key too.
    assert block_keys(list(range(4, 8)), 4, ROOT)[0] != keys[1]


def test_keys_continue_a_chain_from_its_last_key():
    ids = list(range(20))
    whole = block_keys(ids, 4, ROOT)
    assert block_keys(ids, 4, whole[1], first_block=2) == whole[2:]
    assert block_keys(ids, 4, ROOT, upto_block=3) == whole[:3]


def test_large_token_ids_are_not_truncated():
    assert block_keys([2**40, 1], 2, ROOT) != block_keys([0, 1], 2, ROOT)


@pytest.mark.parametrize("identity", [("model-b", "torch.float32", 4), ("model-a", "torch.bfloat16", 4),
                                      ("model-a", "torch.float32", 8)])
def test_no_key_is_shared_across_models_dtypes_or_block_sizes(identity):
    ids = list(range(16))
    assert not set(block_keys(ids, 4, ROOT)) & set(block_keys(ids, 4, root_key(*identity)))


def test_the_last_tokens_block_is_never_reused():
    assert [reusable_blocks(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


# ---- the allocator ----------------------------------------------------------------------------------------------

def test_a_registered_block_is_shared_with_reference_counts():
    alloc = BlockAllocator(4)
    a = alloc.allocate(2)
    assert alloc.register(a[0], "k0") and alloc.register(a[1], "k1")
    hit = alloc.match(["k0", "k1", "k2"])
    assert hit == a  # stops at the first key not cached
    alloc.share(hit)
    assert [alloc.refs(b) for b in a] == [2, 2] and alloc.num_used == 2
    alloc.free(a)  # the first holder leaves: still held by the second
    assert [alloc.refs(b) for b in a] == [1, 1] and alloc.num_free == 2
    alloc.free(a)  # the last holder leaves: cached and free
    assert alloc.num_free == 4 and alloc.num_cached_free == 2 and alloc.num_used == 0
    assert alloc.match(["k0", "k1"]) == a  # still findable
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(a)


def test_a_key_held_by_another_block_is_not_registered_twice():
    alloc = BlockAllocator(3)
    a, b = alloc.allocate(2)
    assert alloc.register(a, "k") and not alloc.register(b, "k")
    assert not alloc.register(a, "other")  # a block has one key
    alloc.free([b])
    assert alloc.num_cached_free == 0  # the unregistered duplicate went back to the heap
    with pytest.raises(ValueError, match="not allocated"):
        alloc.register(b, "k2")


def test_cached_free_blocks_are_evicted_lru_only_when_fresh_ones_run_out():
    alloc = BlockAllocator(4)
    first, second = alloc.allocate(2), alloc.allocate(2)
    for i, b in enumerate(first + second):
        alloc.register(b, f"k{i}")
    alloc.free(first)  # freed first: least recently used
    alloc.free(second)
    assert alloc.num_free == 4 and alloc.num_cached == 4
    # The chain's last block goes before its first: a later block is useless without the earlier ones.
    assert alloc.allocate(1) == [first[1]]
    assert alloc.match(["k0", "k1"]) == [first[0]] and alloc.evictions == 1
    alloc.share(alloc.match(["k2"]))  # a hit takes the block out of the LRU list: it cannot be evicted now
    assert alloc.allocate(2) == [first[0], second[1]]
    assert alloc.match(["k2"]) == [second[0]] and alloc.num_free == 0
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)


def test_fresh_blocks_go_before_cached_ones():
    alloc = BlockAllocator(4)
    a = alloc.allocate(1)
    alloc.register(a[0], "k")
    alloc.free(a)
    assert alloc.allocate(3) == [1, 2, 3] and alloc.match(["k"]) == a
    assert alloc.free_among(a) == 1


def test_only_registered_blocks_can_be_shared():
    alloc = BlockAllocator(2)
    with pytest.raises(ValueError, match="not cached"):
        alloc.share(alloc.allocate(1))


# ---- a sequence over a small pool -------------------------------------------------------------------------------

def pool(blocks: int = 8, caching: bool = True) -> PagedKVPool:
    return PagedKVPool.plan(GQA, torch.float32, "cpu", 64, KVCacheSettings(4, max_tokens=blocks * 4,
                                                                           prefix_caching=caching), identity="m")


def write(cache, ids: list[int]) -> None:
    """Feed `ids` as the model would: reserve, write a value per token (its id), advance."""
    p = cache.pool
    cache.reserve(len(ids))
    slots = p.slots([cache], [len(ids)])
    value = torch.tensor(ids, dtype=torch.float32)[:, None, None].expand(-1, 1, 2)  # [T, 1, 2]
    p.write(0, slots, {"k": value, "v": value})
    cache.length += len(ids)


def test_a_second_sequence_starts_from_the_first_ones_blocks_and_reads_its_values():
    p = pool()
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    a = p.new_sequence()
    assert a.lookup_prefix(prompt).tokens == 0
    write(a, prompt)
    a.commit(prompt)
    assert a.keys and len(a.keys) == 2 and p.allocator.num_cached == 2
    b = p.new_sequence()
    hit = b.lookup_prefix(prompt + [50, 51])
    assert hit.blocks == a.blocks[:2] and b.adopt(hit) == 8
    write(b, [9, 10, 50, 51])  # the rest goes into b's own blocks
    assert b.blocks[:2] == a.blocks[:2] and not set(b.blocks[2:]) & set(a.blocks)
    assert b.read(0)["k"][:, 0, 0].tolist() == prompt + [50, 51]
    assert a.read(0)["k"][:, 0, 0].tolist() == prompt  # a's tokens are untouched


def test_a_prompt_of_whole_blocks_recomputes_its_last_block():
    p = pool()
    prompt = list(range(8))
    a = p.new_sequence()
    write(a, prompt)
    a.commit(prompt)
    assert p.new_sequence().lookup_prefix(prompt).tokens == 4  # block 1 holds the last token: computed again


def test_freed_blocks_stay_cached_and_a_preempted_sequence_finds_them():
    p = pool(blocks=4)
    ids = list(range(14))
    a = p.new_sequence()
    write(a, ids)
    a.commit(ids)
    held = list(a.blocks)
    a.free()  # preempted: every block back, the full ones still cached
    assert p.allocator.num_free == 4 and p.allocator.num_cached_free == 3 and a.keys == []
    hit = a.lookup_prefix(ids + [99])
    assert hit.blocks == held[:3] and a.adopt(hit) == 12
    a.free()
    other = p.new_sequence()
    write(other, [7] * 16)  # needs every block: the cached ones are evicted
    assert p.allocator.num_cached == 0 and p.new_sequence().lookup_prefix(ids).tokens == 0


def test_a_tainted_sequence_registers_nothing_more():
    p = pool()
    a = p.new_sequence()
    write(a, list(range(4)))
    a.commit(list(range(4)))
    a.shareable = False  # e.g. a step degraded its slots
    write(a, list(range(4, 12)))
    assert not a.uncommitted()
    a.commit(list(range(12)))
    assert p.allocator.num_cached == 1
    a.free()
    assert a.shareable  # an emptied cache starts clean


def test_prefix_caching_off_finds_and_registers_nothing():
    p = pool(caching=False)
    a = p.new_sequence()
    write(a, list(range(12)))
    a.commit(list(range(12)))
    assert p.prefix_root is None and p.allocator.num_cached == 0
    assert p.new_sequence().lookup_prefix(list(range(13))).tokens == 0


# ---- reporting --------------------------------------------------------------------------------------------------

def test_status_metrics_and_grpc_usage_report_the_prefix_cache():
    from expertmesh.ops.commands.status import status_lines
    from expertmesh.protos import admin_pb2
    from expertmesh.router_service.batching import DoneEvent
    from expertmesh.router_service.http_metrics import FrontCounters, prometheus_text
    from expertmesh.router_service.proto_mapping import done_message

    stats = admin_pb2.RouterStats(prefix_query_tokens=800, prefix_hit_tokens=600, kv_blocks_cached=37)
    lines = status_lines(admin_pb2.ClusterState(model="m", router=stats))
    assert "prefix cache: 75.0% of prompt tokens served from cache (600 of 800), 37 blocks cached" in lines
    fresh = status_lines(admin_pb2.ClusterState(model="m", router=admin_pb2.RouterStats()))
    assert any(line.startswith("prefix cache: - of prompt tokens") for line in fresh)

    front = FrontCounters()
    front.count_usage({"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}})
    text = prometheus_text(front, {"replica": "r", "prefix_hit_tokens": 600, "prefix_query_tokens": 800,
                                   "kv_blocks_cached": 37})
    assert "expertmesh_http_cached_prompt_tokens_total 32" in text
    assert 'expertmesh_router_prefix_hit_tokens_total{replica="r"} 600' in text
    assert 'expertmesh_router_kv_blocks_cached{replica="r"} 37' in text

    done = DoneEvent("length", prompt_tokens=40, completion_tokens=2, tokens_per_expert={}, cached_tokens=32)
    assert done_message(done).done.usage.cached_tokens == 32
