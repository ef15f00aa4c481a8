"""Replaying the recorded routing trace (docs/benchmarks/results/offload/routing-trace.json) through a decode
scheduler with FIFO or expert-affinity admission (router_service/affinity.py), over offloaded expert actors
(experts/eviction_sim.py's tier model): expert loads per request and request latency in steps. Pure (no torch, no
Ray); tested in tests/unit/test_affinity.py.

Each trace sequence is one request: its first `prompt` tokens are the prompt (its signature: the experts those
tokens picked at the first MoE layer, what a first-layer gate on the prompt gives before admission), the next
`decode` tokens are decoded one per step. Request r arrives at step r * `gap`; at most `batch` decode together; a
step runs every MoE layer over the running requests' tokens and calls actor e at layer l when any of them routes
there (per-expert layout, `share` of each actor's shards resident, eviction `policy`, no prefetch).
"""

from __future__ import annotations

from ..experts.eviction_sim import SimTier
from .affinity import Waiting, admit, admit_fifo, signature


def simulate_admission(trace: dict, admission: str, batch: int = 4, prompt: int = 16, decode: int = 32,
                       gap: float = 0.0, max_wait_steps: float = 32.0, share: float = 0.5,
                       policy: str = "layer-cycle", signature_size: int | None = None) -> dict:
    """admission: "fifo" or "affinity". -> loads per request, shards touched per request, latency percentiles."""
    assert admission in ("fifo", "affinity"), admission
    layers = list(trace["layers"])
    seqs = trace["sequences"]
    assert all(len(s["tokens"]) >= prompt + decode for s in seqs), "trace sequences too short"
    capacity = max(1, round(share * len(layers)))
    tiers = {e: SimTier(policy, capacity, layers) for e in range(trace["num_experts"])}
    for e, tier in tiers.items():
        for layer in layers[:capacity]:
            tier.resident.add((layer, e))
            tier.order.on_admit((layer, e), 0.0)
    sigs = {r: signature((tok["experts"][0] for tok in s["tokens"][:prompt]), signature_size)
            for r, s in enumerate(seqs)}
    arrival = {r: r * gap for r in range(len(seqs))}
    progress: dict[int, int] = {}  # running request -> decode tokens done
    finished: dict[int, float] = {}
    step = 0
    touched = 0
    while len(finished) < len(seqs):
        now = float(step)
        waiting = [Waiting(r, arrival[r], sigs[r]) for r in range(len(seqs))
                   if r not in progress and r not in finished and arrival[r] <= now]
        free = batch - len(progress)
        if free and waiting:
            chosen = (admit_fifo(waiting, free) if admission == "fifo" else
                      admit(waiting, {r: sigs[r] for r in progress}, free, now, max_wait_steps))
            for r in chosen:
                progress[r] = 0
        if progress:
            for i, layer in enumerate(layers):
                used = {e for r in progress for e in seqs[r]["tokens"][prompt + progress[r]]["experts"][i] if e >= 0}
                touched += len(used)
                for e in sorted(used):
                    tiers[e].use((layer, e))
            for r in list(progress):
                progress[r] += 1
                if progress[r] == decode:
                    del progress[r]
                    finished[r] = now + 1 - arrival[r]  # steps from arrival to its last token
        step += 1
    loads = sum(t.demand_loads for t in tiers.values())
    latency = sorted(finished.values())
    return {"admission": admission, "batch": batch, "requests": len(seqs), "steps": step, "gap": gap,
            "share": share, "policy": policy, "max_wait_steps": max_wait_steps,
            "loads_per_request": round(loads / len(seqs), 2),
            "shards_touched_per_request": round(touched / len(seqs), 2),
            "latency_p50_steps": _percentile(latency, 0.5), "latency_p99_steps": _percentile(latency, 0.99),
            "latency_max_steps": latency[-1]}


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    index = min(len(sorted_values) - 1, max(0, int(-(-q * len(sorted_values) // 1)) - 1))
    return sorted_values[index]
