"""The linear-attention state cache beside the paged KV cache (experts/state_cache.py): a slot taken with a
sequence's first tokens, zeroed, freed with it (free, drop, preemption), refused when none is free, budgeted out of
the KV bytes; and the continuous batcher over a Qwen3-Next and a Kimi-Linear model with fewer slots than requests:
admission waits for a slot, preemption frees it and the recompute gives the same tokens. No Ray."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from expertmesh.experts.kv_cache import KVCacheSettings, OutOfBlocks, PagedKVPool
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.state_cache import StatePool, state_bytes_per_sequence
from expertmesh.router_service.batching import ContinuousBatcher, DoneEvent, GenerationRequest
from tests.tiny_kimi_linear import write_kimi_linear_checkpoint
from tests.tiny_qwen3_next import write_qwen3_next_checkpoint

SHAPES = [{"conv": (6, 3), "recurrent": (2, 4, 3)}, {}]  # a linear layer, then an attention layer


def _pool(slots: int = 2, blocks: int = 8) -> PagedKVPool:
    return PagedKVPool([{}, {"k": (1, 4), "v": (1, 4)}], blocks, 4, torch.bfloat16,
                       states=StatePool(SHAPES, slots, torch.bfloat16))


def test_slot_taken_with_the_first_tokens_zeroed_and_freed_with_the_sequence():
    pool = _pool()
    a, b, c = pool.new_sequence(), pool.new_sequence(), pool.new_sequence()
    assert a.state_slot is None and a.needs_state()
    a.reserve(0)
    assert a.state_slot is None  # nothing to hold yet
    a.reserve(3)
    assert a.state_slot is not None and not a.needs_state() and pool.states.num_free == 1
    pool.states.views(0, [a.state_slot])["recurrent"][0].fill_(7.0)
    a.reserve(5)  # more tokens, the same slot
    b.reserve(1)
    with pytest.raises(OutOfBlocks, match="state cache"):
        c.reserve(1)
    assert c.blocks == [] and pool.allocator.num_free == 8 - 2 - 1  # refused whole: no block taken either
    slot = a.state_slot
    a.free()
    assert a.state_slot is None and pool.states.num_free == 1 and a.needs_state()
    c.reserve(2)
    assert c.state_slot == slot
    assert pool.states.views(0, [slot])["recurrent"][0].abs().sum() == 0  # handed out zeroed
    del b
    gc.collect()
    assert pool.states.num_free == 1  # a dropped sequence gives its slot back


def test_state_dtypes_and_bytes():
    pool = _pool()
    assert pool.states.storage[0]["conv"].dtype == torch.bfloat16
    assert pool.states.storage[0]["recurrent"].dtype == torch.float32  # as transformers keeps it
    assert pool.states.storage[1] == {}
    per_seq = state_bytes_per_sequence(SHAPES, torch.bfloat16)
    assert per_seq == 6 * 3 * 2 + 2 * 4 * 3 * 4
    assert pool.states.nbytes() == 2 * per_seq


def test_plan_takes_the_slots_out_of_the_budget_and_turns_prefix_caching_off():
    specs = [{}, {"k": (1, 4), "v": (1, 4)}]
    per_seq = state_bytes_per_sequence(SHAPES, torch.float32)
    budget = 100 * 4 * 8 * 4 + 3 * per_seq  # 100 blocks of 4 tokens (8 floats each) plus 3 states
    pool = PagedKVPool.plan(specs, torch.float32, "cpu", 1 << 20,
                            KVCacheSettings(4, budget, max_tokens=1 << 40, state_slots=3), state_shapes=SHAPES)
    assert pool.states.slots == 3 and pool.num_blocks == 100 and pool.prefix_root is None
    plain = PagedKVPool.plan(specs, torch.float32, "cpu", 1 << 20, KVCacheSettings(4, budget, max_tokens=1 << 40))
    assert plain.states is None and plain.prefix_root is not None and plain.num_blocks > 100
    few = PagedKVPool.plan(specs, torch.float32, "cpu", 1 << 20,  # 3 asked, room for 2 in half the budget
                           KVCacheSettings(4, 5 * per_seq, max_tokens=1 << 40, state_slots=3), state_shapes=SHAPES)
    assert few.states.slots == 2 and few.num_blocks == 3 * per_seq // (4 * 8 * 4)
    with pytest.raises(ValueError, match="linear-attention state"):
        PagedKVPool.plan(specs, torch.float32, "cpu", 1 << 20,
                         KVCacheSettings(4, per_seq, max_tokens=1 << 40, state_slots=3), state_shapes=SHAPES)


# ---------------------------------------------------------------- the batcher over a Qwen3-Next model


@pytest.fixture(scope="module", params=["qwen3_next", "kimi_linear"])
def reference(request, tmp_path_factory):
    """Qwen3-Next (Gated DeltaNet, GQA) or Kimi-Linear (KDA with per-channel decay, MLA's latent cache)."""
    if request.param == "kimi_linear":
        return load_reference_model(write_kimi_linear_checkpoint(tmp_path_factory.mktemp("kimi") / "k"))
    return load_reference_model(write_qwen3_next_checkpoint(tmp_path_factory.mktemp("qn") / "next", "next"))


def _solo(model, prompt: list[int], max_tokens: int) -> list[int]:
    cache, out, ids = model.new_cache(), [], prompt
    while len(out) < max_tokens:
        out.append(int(model.forward([torch.tensor(ids)], [cache])[0][-1].argmax()))
        ids = out[-1:]
    return out


async def _collect(stream) -> list[int]:
    tokens = []
    async for event in stream:
        if not isinstance(event, DoneEvent):
            tokens.extend(event.token_ids)
    return tokens


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("slots,blocks", [(2, 64), (4, 9)])
def test_batcher_waits_for_a_state_slot_and_preemption_recomputes_the_state(reference, slots, blocks):
    """Four streams: with 2 state slots two run at a time (admission waits for a slot); with 9 blocks of 4 decode
    outgrows the KV pool and the youngest is preempted (slot freed, state rebuilt by the recompute). Every stream
    equals its solo run and every slot is back at the end."""
    model = MoEDecoder(reference.cfg, reference.w, reference.experts,
                       kv_cache=KVCacheSettings(4, max_tokens=blocks * 4, state_slots=slots))
    prompts, max_tokens = [_prompt(n, n) for n in (6, 9, 5, 7)], 10
    solos = [_solo(reference, p, max_tokens) for p in prompts]

    async def main():
        batcher = ContinuousBatcher(model, None)
        got = await asyncio.wait_for(asyncio.gather(
            *(_collect(batcher.stream(GenerationRequest(p, max_tokens))) for p in prompts)), 60)
        return batcher, got

    batcher, got = asyncio.run(main())
    assert got == solos
    if blocks < 16:
        assert batcher.preemptions >= 1
    assert model.kv_pool.states.num_free == slots and model.kv_pool.allocator.num_free == blocks
