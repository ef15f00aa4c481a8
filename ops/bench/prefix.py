"""`expertmesh bench prefix`: time to first token of a prompt whose long system prompt the prefix cache holds, against
an unseen prompt of the same length (README: Prefix caching).

In process (no Ray, no gRPC): the embedded model (experts/default_model, 512 positions) as the in-process reference
behind the continuous batcher (router_service/batching.py) with its default settings, so what is measured is the
prefill the cache saves. A request is `system_tokens` of a fixed system prompt + `user_tokens` of its own, max_tokens
1, sent alone; time to first token is from `stream()` to its first token. Rounds alternate:
  warm     the system prompt was served before (cached blocks): only the last block(s) are computed
  unseen   a prompt of the same length never seen (every token computed), with the cache on
  off      the warm prompt again on a batcher whose pool has prefix caching off (the same work as unseen)
and the JSON gives each one's median and the unseen / warm ratio (the issue's target: ≥ 3×).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import torch

from .common import all_cores, machine_info, say_to_stderr


@dataclass(frozen=True)
class PrefixParams:
    system_tokens: int = 384
    user_tokens: int = 16
    rounds: int = 9
    model_dir: str | None = None  # None: the embedded model
    threads: int | None = None  # torch threads; None: every core (on a busy box 1 is steadier)

    @classmethod
    def from_args(cls, args) -> PrefixParams:
        return cls(args.system_tokens, args.user_tokens, args.rounds, args.model, args.threads)


def run_prefix_bench(params: PrefixParams = PrefixParams(), verbose: bool = True) -> dict:
    from ...experts.embedded_model import EMBEDDED_MODEL_DIR
    from ...experts.kv_cache import KVCacheSettings
    from ...experts.modeling import MoEDecoder
    from ...experts.reference import load_reference_model
    from ...router_service.batching import ContinuousBatcher

    say = say_to_stderr(verbose)
    if params.threads is None:
        all_cores()
    else:
        torch.set_num_threads(params.threads)
    model_dir = params.model_dir or str(EMBEDDED_MODEL_DIR)
    reference = load_reference_model(model_dir)
    vocab, length = reference.cfg.vocab_size, params.system_tokens + params.user_tokens
    if length + 1 > reference.cfg.max_position_embeddings:
        raise SystemExit(f"--system-tokens + --user-tokens: {length} do not fit the model's "
                         f"{reference.cfg.max_position_embeddings} positions")
    gen = torch.Generator().manual_seed(0)

    def draw(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    def batcher(caching: bool) -> ContinuousBatcher:
        model = MoEDecoder(reference.cfg, reference.w, reference.experts,
                           kv_cache=KVCacheSettings(prefix_caching=caching))
        return ContinuousBatcher(model, None)

    system = draw(params.system_tokens)
    on, off = batcher(True), batcher(False)
    times: dict[str, list[float]] = {"warm": [], "unseen": [], "off": []}
    cached: list[int] = []

    async def main() -> None:
        await _ttft(on, system + draw(params.user_tokens))  # fills the cache with the system prompt
        await _ttft(on, draw(length))  # first-call warm-up of the unseen path too
        await _ttft(off, system + draw(params.user_tokens))
        for r in range(params.rounds):
            say(f"round {r + 1}/{params.rounds} ...")
            seconds, hit = await _ttft(on, system + draw(params.user_tokens))
            times["warm"].append(seconds)
            cached.append(hit)
            times["unseen"].append((await _ttft(on, draw(length)))[0])
            times["off"].append((await _ttft(off, system + draw(params.user_tokens)))[0])

    asyncio.run(main())
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "benchmark": "prefix-cache-ttft", "model": model_dir, "in_process": True, "machine": machine_info(),
        "prompt_tokens": length, "system_tokens": params.system_tokens, "rounds": params.rounds,
        "threads": torch.get_num_threads(),
        "block_size": on.model.kv_pool.block_size, "cached_tokens": statistics.median(cached),
        "ttft_s": {k: {"median": round(m, 5), "min": round(min(times[k]), 5), "max": round(max(times[k]), 5)}
                   for k, m in medians.items()},
        "unseen_over_warm": round(medians["unseen"] / medians["warm"], 2),
        "unseen_over_warm_min": round(min(times["unseen"]) / min(times["warm"]), 2),
        "off_over_warm": round(medians["off"] / medians["warm"], 2),
    }


async def _ttft(batcher, prompt: list[int]) -> tuple[float, int]:
    """Seconds from the request to its first token, and the prompt tokens the prefix cache served."""
    from ...router_service.batching import DoneEvent, GenerationRequest

    started, first, cached = time.perf_counter(), None, 0
    async for event in batcher.stream(GenerationRequest(prompt, 1)):
        if first is None:
            first = time.perf_counter() - started
        if isinstance(event, DoneEvent):
            cached = event.cached_tokens
    return first, cached
