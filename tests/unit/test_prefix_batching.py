"""Prefix caching through the continuous batcher, in process (no Ray): requests that share a long prefix get the same
greedy tokens and the same logits with the cache as without it, served one after another, concurrently, after
their cached blocks were evicted, and after preemption; in families with sliding windows and sinks (gpt-oss) and MLA
latents (DeepSeek-V3) too. `cached_tokens` counts what the cache served."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from expertmesh.experts.kv_cache import KVCacheSettings
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.batching import (
    BatcherConfig,
    ContinuousBatcher,
    DoneEvent,
    GenerationRequest,
    _Sequence,
    _StepRouting,
)
from tests.tiny_checkpoints import write_hf_checkpoint
from tests.tiny_deepseek import write_deepseek_checkpoint

TIMEOUT = 60.0
BLOCK = 4
# Logits of the suffix computed over cached keys / values vs over freshly computed ones: the same numbers through
# different kernels (masked SDPA over gathered blocks vs causal SDPA over the new tokens), so equal up to float32
# rounding; greedy tokens are equal exactly.
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def families(checkpoints, tmp_path_factory) -> dict[str, MoEDecoder]:
    root = tmp_path_factory.mktemp("prefix")
    mla = write_deepseek_checkpoint("deepseek_v3", root / "deepseek_v3", seed=4)
    return {"mixtral": load_reference_model(checkpoints["mixtral"]),
            # sliding window 4 on every other layer (shorter than the prefix), attention sinks
            "gpt_oss": load_reference_model(write_hf_checkpoint("gpt_oss", root / "gpt_oss", seed=5)),
            "deepseek_v3": load_reference_model(mla),  # MLA latents
            # MLA + the DSA indexer's keys in the same blocks; top-8 of a 41-token prefix, shared-indexer layers
            "glm_moe_dsa": load_reference_model(write_deepseek_checkpoint("glm_moe_dsa", root / "glm_moe_dsa", seed=4))}


def decoder(reference: MoEDecoder, caching: bool, blocks: int = 64) -> MoEDecoder:
    return MoEDecoder(reference.cfg, reference.w, reference.experts,
                      kv_cache=KVCacheSettings(BLOCK, max_tokens=blocks * BLOCK, prefix_caching=caching))


def ids(length: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


async def collect(stream) -> tuple[list[int], list[float], DoneEvent]:
    tokens, logprobs, done = [], [], None
    async for event in stream:
        if isinstance(event, DoneEvent):
            done = event
        else:
            tokens.extend(event.token_ids)
            logprobs.extend(lp for lp, _ in event.logprobs)
    return tokens, logprobs, done


def serve(model: MoEDecoder, waves: list[list[list[int]]], max_tokens: int = 6,
          config: BatcherConfig | None = None) -> tuple[ContinuousBatcher, list]:
    """Each wave's prompts served together (greedy, with logprobs), the waves one after another on one batcher."""

    async def main():
        batcher = ContinuousBatcher(model, None, config or BatcherConfig(max_prefill_tokens=16))
        out = []
        for wave in waves:
            out.extend(await asyncio.gather(*(
                collect(batcher.stream(GenerationRequest(p, max_tokens, top_logprobs=0))) for p in wave)))
        return batcher, out

    async def guarded():
        return await asyncio.wait_for(main(), TIMEOUT)

    return asyncio.run(guarded())


def assert_same(cached: list, plain: list) -> float:
    """Same greedy tokens; logprobs within LOGPROB_ATOL. -> the largest logprob difference."""
    worst = 0.0
    for (tokens, logprobs, _), (want_tokens, want_logprobs, _) in zip(cached, plain, strict=True):
        assert tokens == want_tokens
        worst = max(worst, max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)))
    assert worst <= LOGPROB_ATOL, worst
    return worst


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3", "glm_moe_dsa"])
def test_shared_prefix_hits_and_outputs_equal_the_uncached_ones(families, family):
    """A 41-token system prompt: the first request computes it, the next three (together) start from its 10 cached
    blocks and compute only their own suffixes; tokens and logits equal a run with caching off."""
    reference = families[family]
    vocab = reference.cfg.vocab_size
    system = ids(41, 1, vocab)
    waves = [[system + ids(5, 2, vocab)], [system + ids(n, 10 + n, vocab) for n in (3, 8, 1)]]
    batcher, cached = serve(decoder(reference, True), waves)
    _, plain = serve(decoder(reference, False), waves)
    assert_same(cached, plain)
    assert [done.cached_tokens for *_, done in cached] == [0, 40, 40, 40]
    assert all(done.cached_tokens == 0 for *_, done in plain)
    assert all(done.prompt_tokens == len(p) for (*_, done), p in zip(cached, waves[0] + waves[1]))
    stats = batcher.stats()
    assert stats["prefix_hit_tokens"] == 120 and stats["prefix_query_tokens"] == sum(map(len, waves[0] + waves[1]))
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["kv_blocks_cached"] > 10


def test_concurrent_requests_with_one_prefix_compute_it_and_then_share_it(families):
    """Four requests with one prefix arrive together: all are admitted before any block is registered, so each
    computes the prefix (the duplicates stay private); a fifth, later, finds one cached copy. Same outputs."""
    reference = families["mixtral"]
    system = ids(33, 3, 96)
    waves = [[system + ids(n, 20 + n, 96) for n in (2, 4, 6, 8)], [system + ids(3, 40, 96)]]
    batcher, cached = serve(decoder(reference, True), waves)
    _, plain = serve(decoder(reference, False), waves)
    assert_same(cached, plain)
    assert [done.cached_tokens for *_, done in cached] == [0, 0, 0, 0, 32]


def test_evicted_prefixes_are_recomputed_and_outputs_stay_equal(families):
    """A 12-block pool: prompt A (9 blocks) is cached, prompt B's 10 blocks evict most of it, A again finds only
    what survived; every output equals the uncached one."""
    reference = families["mixtral"]
    a, b = ids(34, 5, 96), ids(38, 6, 96)
    waves = [[a], [b], [a + [1]]]
    batcher, cached = serve(decoder(reference, True, blocks=12), waves, max_tokens=4)
    _, plain = serve(decoder(reference, False, blocks=12), waves, max_tokens=4)
    assert_same(cached, plain)
    assert reference.kv_pool is not None
    hits = [done.cached_tokens for *_, done in cached]
    assert hits[0] == hits[1] == 0 and hits[2] < 32  # part of A's chain was evicted for B
    assert batcher.model.kv_pool.allocator.evictions > 0


def test_preemption_with_caching_gives_the_uncached_tokens_and_routing_counts(families):
    """Three streams outgrow an 8-block pool: the youngest is preempted and recomputed (from what of its blocks
    stayed cached); outputs and per-expert counts equal a run with caching off."""
    reference = families["mixtral"]
    waves = [[ids(6, 1, 96), ids(7, 2, 96), ids(5, 3, 96)]]
    batcher, cached = serve(decoder(reference, True, blocks=8), waves, max_tokens=10)
    plain_batcher, plain = serve(decoder(reference, False, blocks=8), waves, max_tokens=10)
    assert batcher.preemptions >= 1 and plain_batcher.preemptions >= 1
    assert_same(cached, plain)
    for (*_, done), (*_, want) in zip(cached, plain):
        assert done.tokens_per_expert == want.tokens_per_expert  # recomputed tokens are counted once
    assert batcher.prefix_query_tokens == 18  # a recompute's hits are not the request's cached prompt tokens


@pytest.mark.parametrize("moved", ["rerouted", "dropped", "degraded", "shed"])
def test_a_step_that_moved_a_sequences_slots_stops_it_registering_blocks(families, moved):
    """A step that rerouted (capacity cap), dropped, degraded or shed a sequence's slots computed its tokens with
    other experts than the model would choose: its blocks from then on must not be found by other requests."""
    model = decoder(families["mixtral"], True)
    cache = model.new_cache()
    seq = _Sequence(request=GenerationRequest(list(range(12)), 1), events=None, cache=cache,
                    next_input=torch.tensor([]), generator=None)
    cache.reserve(8)
    cache.length = 8
    ContinuousBatcher._commit_blocks(seq, _StepRouting())
    assert model.kv_pool.allocator.num_cached == 2
    cache.reserve(4)
    cache.length = 12
    ContinuousBatcher._commit_blocks(seq, dataclasses.replace(_StepRouting(), **{moved: 1}))
    assert model.kv_pool.allocator.num_cached == 2 and not cache.shareable
    cache.free()


def test_bench_prefix_reports_the_cached_tokens_and_both_timings():
    from expertmesh.ops.bench.prefix import PrefixParams, run_prefix_bench

    got = run_prefix_bench(PrefixParams(system_tokens=64, user_tokens=8, rounds=1, threads=1), verbose=False)
    assert got["cached_tokens"] == 64 and got["prompt_tokens"] == 72 and got["threads"] == 1
    assert all(got["ttft_s"][k]["median"] > 0 for k in ("warm", "unseen", "off"))
