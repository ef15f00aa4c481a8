"""`expertmesh bench chunked`: inter-token latency of running streams while a long prompt is prefilled, with and
without chunked prefill, against their latency with no long prompt.

In process (no Ray, no gRPC): the dispatch benchmark's model (checkpoints.MIXTRAL, fp32, context raised to
fit the prompt) as the in-process reference, behind the continuous batcher (router_service/batching.py), so what is
measured is the step schedule. `streams` streams with short prompts decode; once each has produced a few tokens, a
`prompt_tokens` prompt arrives (max_tokens 1). For each scenario the gaps between consecutive tokens of the running
streams are collected from that moment until the long request is done (baseline: over the same number of steps
with no long prompt), and their p50/p99 reported:
  baseline             no long prompt
  unchunked            max_prefill_tokens ≥ the prompt: it is prefilled in one step
  chunked(C)           max_prefill_tokens = C: a chunk of C prompt tokens per step, streams decode in every step
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoints import MIXTRAL, write_bench_checkpoint
from .common import all_cores, machine_info, say_to_stderr


@dataclass(frozen=True)
class ChunkedParams:
    prompt_tokens: int = 4096
    streams: int = 8
    chunks: tuple[int, ...] = (64, 256)  # max_prefill_tokens tried
    model: dict = field(default_factory=lambda: MIXTRAL)

    @classmethod
    def from_args(cls, args) -> ChunkedParams:
        return cls(args.prompt_tokens, args.streams, tuple(int(c) for c in args.chunks.split(",")))


def run_chunked_bench(params: ChunkedParams = ChunkedParams(), verbose: bool = True) -> dict:
    from ...experts.reference import load_reference_model

    say = say_to_stderr(verbose)
    prompt_tokens, streams, vocab = params.prompt_tokens, params.streams, params.model["vocab"]
    all_cores()
    result: dict = {"benchmark": "chunked-prefill", "model": params.model, "prompt_tokens": prompt_tokens,
                    "streams": streams, "in_process": True, "machine": machine_info()}
    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-") as tmp:
        say("writing benchmark checkpoint ...")
        model_dir = write_bench_checkpoint(Path(tmp) / "model", params.model, max_positions=prompt_tokens + 1024)
        model = load_reference_model(model_dir)
        scenarios = {}
        say("baseline ...")
        scenarios["baseline"] = asyncio.run(_scenario(model, vocab, streams, None, prompt_tokens + 1, steps=48))
        say("unchunked ...")
        scenarios["unchunked"] = asyncio.run(_scenario(model, vocab, streams, prompt_tokens, prompt_tokens + 1))
        for chunk in params.chunks:
            say(f"chunked {chunk} ...")
            scenarios[f"chunked_{chunk}"] = asyncio.run(_scenario(model, vocab, streams, prompt_tokens, chunk))
    base = scenarios["baseline"]["inter_token_p99_s"]
    for s in scenarios.values():
        s["p99_vs_baseline"] = round(s["inter_token_p99_s"] / base, 3)
    result["scenarios"] = scenarios
    return result


async def _scenario(model, vocab: int, streams: int, long_prompt: int | None, max_prefill_tokens: int,
                    steps: int = 0) -> dict:
    """Gaps between tokens of the running streams while the long prompt is served (or for `steps` steps)."""
    from ...router_service.batching import BatcherConfig, ContinuousBatcher, GenerationRequest

    batcher = ContinuousBatcher(model, None, BatcherConfig(max_prefill_tokens=max_prefill_tokens))
    gen = torch.Generator().manual_seed(1)
    last_seen: dict[int, float] = {}
    gaps: list[float] = []
    recording = False
    warm = asyncio.Event()
    counts = [0] * streams
    errors: list[BaseException] = []
    # Long enough to outlast the scenario (they are cancelled at its end), within the context.
    max_tokens = model.cfg.max_position_embeddings - 16

    async def consume(i: int) -> None:
        request = GenerationRequest(torch.randint(0, vocab, (16,), generator=gen).tolist(), max_tokens)
        try:
            async with contextlib.aclosing(batcher.stream(request)) as events:
                async for _ in events:
                    now = time.perf_counter()
                    if recording and i in last_seen:
                        gaps.append(now - last_seen[i])
                    last_seen[i] = now
                    counts[i] += 1
                    if min(counts) >= 3:
                        warm.set()
        except Exception as exc:  # surface it instead of waiting for a warm-up that never comes
            errors.append(exc)
            warm.set()

    tasks = [asyncio.ensure_future(consume(i)) for i in range(streams)]
    await warm.wait()
    if errors:
        raise errors[0]
    recording = True
    started, steps_before = time.perf_counter(), batcher.steps
    if long_prompt is not None:
        request = GenerationRequest(torch.randint(0, vocab, (long_prompt,), generator=gen).tolist(), 1)
        async for _ in batcher.stream(request):
            pass
    else:
        while batcher.steps < steps_before + steps:
            await asyncio.sleep(0.005)
    elapsed, steps_taken = time.perf_counter() - started, batcher.steps - steps_before
    recording = False
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps.sort()
    return {
        "max_prefill_tokens": max_prefill_tokens,
        "steps": steps_taken,
        "seconds": round(elapsed, 3),
        "gaps": len(gaps),
        "inter_token_p50_s": round(statistics.median(gaps), 5),
        "inter_token_p99_s": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 5),
        "inter_token_max_s": round(gaps[-1], 5),
        "long_prompt_s": round(elapsed, 3) if long_prompt is not None else None,
    }
