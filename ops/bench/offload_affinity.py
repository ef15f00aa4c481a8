"""FIFO against expert-affinity admission served through an offloaded mesh (`bench offload`, README: Offload).

The benchmark model's routing is random, so its router-side weights are bent into topics first (two by default;
ops/bench/topics.py: embeddings, gates, lm_head; the actors' experts untouched) and put back afterwards. The same
burst of requests (cycling through the topics, prompts from the topic's part of the vocabulary) is served through a
ContinuousBatcher over the mesh's model, once per admission policy per round, the policies alternating (the box is
shared: its load drifts). Per run: expert shards called per request and per step (the batcher's counters), the
actors' demand loads per request (tier misses), bytes moved, request latency p50 / p99 (submit to last token), and
whether every request's tokens equal FIFO's of the same round.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from .offload_report import counter_delta


@dataclass(frozen=True)
class AffinityWorkload:
    requests: int = 16
    prompt: int = 16
    max_tokens: int = 16
    max_active: int = 4
    max_wait_s: float = 60.0  # affinity's fairness bound
    rounds: int = 2  # FIFO, affinity, FIFO, affinity, ...
    strength: float = 3.0  # make_topical's
    topics: int = 2  # requests cycle through them; each gets 1/topics of the experts (make_topical)


def serve_fifo_vs_affinity(mesh, actor_totals, workload: AffinityWorkload = AffinityWorkload()) -> dict:
    """mesh: an ExpertMesh (its router's dense weights are bent for the run and restored); actor_totals(mesh) -> the
    actors' summed tier counters. -> {"workload", "runs": [...], "summary": {...}}."""
    from .topics import make_topical, topic_prompt

    model = mesh.model
    saved = _dense_copies(model.w)
    make_topical(model.w, model.cfg.num_experts, workload.strength, topics=workload.topics)
    prompts = [topic_prompt(r % workload.topics, workload.prompt, model.cfg.vocab_size, seed=1000 + r,
                            topics=workload.topics)
               for r in range(workload.requests)]
    runs = []
    try:
        prefetcher, mesh.backend.prefetcher = mesh.backend.prefetcher, None  # on demand: loads are the admission's
        for round_ in range(workload.rounds):
            fifo_tokens = None
            for admission in ("fifo", "affinity"):
                run = _serve_once(mesh, actor_totals, admission, prompts, workload)
                run["round"] = round_
                if admission == "fifo":
                    fifo_tokens = run.pop("_tokens")
                else:
                    run["same_tokens_as_fifo"] = run.pop("_tokens") == fifo_tokens
                runs.append(run)
    finally:
        mesh.backend.prefetcher = prefetcher
        _restore(model.w, saved)
    return {"workload": workload.__dict__, "runs": runs, "summary": summarize(runs)}


def summarize(runs: list[dict]) -> dict:
    """Per policy, the best (lowest) of its rounds for loads and p99; affinity / FIFO ratios of those."""
    best = {}
    for policy in ("fifo", "affinity"):
        mine = [r for r in runs if r["admission"] == policy]
        if not mine:
            return {}
        best[policy] = {k: min(r[k] for r in mine) for k in
                        ("demand_loads_per_request", "shard_calls_per_request", "latency_p99_s", "latency_p50_s")}
    f, a = best["fifo"], best["affinity"]
    return {"best": best,
            "loads_fewer_x": round(f["demand_loads_per_request"] / max(a["demand_loads_per_request"], 1e-9), 2),
            "shard_calls_fewer_x": round(f["shard_calls_per_request"] / max(a["shard_calls_per_request"], 1e-9), 2),
            "p99_vs_fifo": round(a["latency_p99_s"] / f["latency_p99_s"], 3),
            "same_tokens": all(r.get("same_tokens_as_fifo", True) for r in runs)}


def _serve_once(mesh, actor_totals, admission: str, prompts: list[list[int]], workload: AffinityWorkload) -> dict:
    from ...router_service.batching import BatcherConfig, ContinuousBatcher, DoneEvent, GenerationRequest

    config = BatcherConfig(max_active=workload.max_active, admission=admission,
                           affinity_max_wait_s=workload.max_wait_s)
    before = actor_totals(mesh)

    async def main():
        batcher = ContinuousBatcher(mesh.model, None, config)

        async def one(p):
            submitted, tokens = time.perf_counter(), []
            async for event in batcher.stream(GenerationRequest(prompt_ids=p, max_tokens=workload.max_tokens)):
                if not isinstance(event, DoneEvent):
                    tokens.extend(event.token_ids)
            return tokens, time.perf_counter() - submitted

        started = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return batcher, results, time.perf_counter() - started

    batcher, results, wall = asyncio.run(main())
    tiers = counter_delta(before, actor_totals(mesh))
    stats = batcher.stats()
    latency = sorted(s for _, s in results)
    n = len(prompts)
    return {"admission": admission, "requests": n, "steps": stats["steps"], "wall_s": round(wall, 3),
            "shard_calls_per_request": round(stats["expert_shard_calls"] / n, 2),
            "shard_calls_per_step": round(stats["expert_shard_calls"] / max(1, stats["steps"]), 2),
            "demand_loads_per_request": round(tiers["misses"] / n, 2),
            "gb_moved": round(tiers["bytes_moved"] / 1e9, 3), "stall_s": round(tiers["stall_s"], 3),
            "latency_p50_s": round(latency[(n - 1) // 2], 3),
            "latency_p99_s": round(latency[min(n - 1, -(-99 * n // 100) - 1)], 3),
            "_tokens": [t for t, _ in results]}


def _dense_copies(weights) -> list:
    return [weights.embed.clone(), weights.lm_head.clone() if weights.lm_head is not None else None,
            [None if layer.router is None else layer.router.clone() for layer in weights.layers]]


def _restore(weights, saved: list) -> None:
    embed, head, routers = saved
    weights.embed.copy_(embed)
    if head is not None:
        weights.lm_head.copy_(head)
    for layer, router in zip(weights.layers, routers):
        if router is not None:
            layer.router.copy_(router)

