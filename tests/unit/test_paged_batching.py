"""Continuous batching over a small paged KV cache: admission by blocks, preemption of the youngest sequence with
recompute (same tokens, same routing counts), refusal of requests the cache can never hold. No Ray."""

from __future__ import annotations

import asyncio

import pytest
import torch

from expertmesh.experts.kv_cache import KVCacheSettings
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.batching import BatcherConfig, ContinuousBatcher, DoneEvent, GenerationRequest
from expertmesh.router_service.errors import RequestError

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def reference(checkpoints):
    return load_reference_model(checkpoints["mixtral"])


def small(reference: MoEDecoder, blocks: int, block_size: int = 4) -> MoEDecoder:
    """The reference's weights and experts over a pool of `blocks` blocks."""
    return MoEDecoder(reference.cfg, reference.w, reference.experts,
                      kv_cache=KVCacheSettings(block_size, max_tokens=blocks * block_size))


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def solo_greedy(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], dict[int, list[int]]]:
    cache, out, per_expert = model.new_cache(), [], {}
    ids = prompt_ids
    while len(out) < max_tokens:
        logits = model.forward([torch.tensor(ids)], [cache])[0][-1]
        for layer, routing in model.last_trace.routings.items():
            per_expert[layer] = per_expert.get(layer, 0) + routing.tokens_per_expert(model.cfg.num_experts)
        out.append(int(logits.argmax()))
        ids = out[-1:]
    return out, {layer: c.tolist() for layer, c in sorted(per_expert.items())}


async def collect(stream) -> tuple[list[int], DoneEvent]:
    tokens, done = [], None
    async for event in stream:
        if isinstance(event, DoneEvent):
            done = event
        else:
            tokens.extend(event.token_ids)
    return tokens, done


def run(coro):
    async def guarded():
        return await asyncio.wait_for(coro, TIMEOUT)

    return asyncio.run(guarded())


def test_decode_out_of_blocks_preempts_the_youngest_and_recomputes_the_same_tokens(reference):
    """Three streams that together outgrow 8 blocks of 4: the youngest is preempted (blocks freed, requeued) and
    recomputed from prompt + generated tokens later; every stream still equals its solo run, routing counts too,
    and every block is back at the end."""
    model = small(reference, blocks=8)
    prompts, max_tokens = [prompt(6, 1), prompt(7, 2), prompt(5, 3)], 10
    solos = [solo_greedy(reference, p, max_tokens) for p in prompts]

    async def main():
        batcher = ContinuousBatcher(model, None)
        results = await asyncio.gather(*(collect(batcher.stream(GenerationRequest(p, max_tokens))) for p in prompts))
        return batcher, results

    batcher, results = run(main())
    assert batcher.preemptions >= 1
    for (tokens, done), (want, want_per_expert) in zip(results, solos):
        assert tokens == want
        assert done.completion_tokens == max_tokens
        assert done.tokens_per_expert == want_per_expert  # recomputed tokens are not counted twice
    stats = batcher.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 8 and stats["live_caches"] == 0


def test_a_request_waits_for_its_prompts_blocks(reference):
    """6 blocks of 4: two 14-token prompts (4 blocks each) cannot run together, so the second is admitted only
    when the first finishes and frees its blocks."""
    model = small(reference, blocks=6)
    prompts = [prompt(14, 10), prompt(14, 11)]

    async def main():
        batcher = ContinuousBatcher(model, None, BatcherConfig(max_active=8))
        results = await asyncio.gather(*(collect(batcher.stream(GenerationRequest(p, 5))) for p in prompts))
        return batcher, results

    batcher, results = run(main())
    assert batcher.max_batch_seen == 1 and batcher.preemptions == 0
    assert [r[0] for r in results] == [solo_greedy(reference, p, 5)[0] for p in prompts]


@pytest.mark.parametrize(("length", "max_tokens", "field"), [(40, 1, "prompt"), (20, 20, "max_tokens")])
def test_a_request_that_can_never_fit_is_refused_naming_its_length_and_the_limit(reference, length, max_tokens,
                                                                                field):
    model = small(reference, blocks=8)  # 32 tokens

    async def main():
        batcher = ContinuousBatcher(model, None)
        await collect(batcher.stream(GenerationRequest(prompt(length, 20), max_tokens)))

    with pytest.raises(RequestError) as err:
        run(main())
    assert err.value.field == field
    assert f"{length} tokens" in str(err.value) and "at most 32 tokens" in str(err.value)
    assert model.kv_pool.allocator.num_free == 8
