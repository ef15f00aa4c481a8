"""`expertmesh bench offload`: serving with part of the experts resident (README: Offload), against all-resident in
the same run.

One mesh per residency level (100 % = no budget, today's path; 50 % and 25 % = `experts.memory_gb` set to that share
of each actor's shards), on the `bench dispatch` Mixtral-like model (hidden 1024, ffn 2816, 8 experts top-2; 4
layers, so each actor hosts 4 shards and 50 % / 25 % are 2 / 1 of them). In each offloaded mesh the same workload
runs without prefetch and with each prefetch mode (the prediction is router-side, so the mesh is reused). Every run
feeds the same tokens, and its logits are compared with the all-resident run's (bit-identical is the guarantee).

Per run: prefill and decode tokens/s (best repeat / best step) and their ratio to all-resident (the faster of
two resident runs, one first and one last), the actors' hit rate, stall share (time their calls waited on loads,
over their forward time), bytes moved, prefetch issued/useful and the router's prediction recall; per level, the
share of on-demand stall that prefetch removed.

`quant`: a list of expert quantisation modes; values other than "none" are passed as `experts.quant` (issue 15
item 3), one set of runs each, compared with that mode's own all-resident run (the benchmark model is float32,
where quantised experts dequantise per call: experts/quant.py).

`perplexity`: the benchmark model has random weights, so quality is measured on the embedded model instead: per
quantisation mode, its held-out perplexity (ops/perplexity.py) in process with every expert resident, and served
through actors holding half their shards with pre-gating prefetch. Offload moves weights, not values, so the two
must agree exactly (the run says whether they did); what a mode costs in quality is its resident figure against
"none"'s.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...router_service.config import MeshConfig
from .checkpoints import MIXTRAL, write_bench_checkpoint
from .common import all_cores, machine_info, say_to_stderr
from .offload_affinity import AffinityWorkload, serve_fifo_vs_affinity
from .offload_governor import GovernorWorkload, decode_with_and_without_governor
from .offload_report import TIER_KEYS, counter_delta, rebase_on_best_resident, stall_removed_by_prefetch, tier_summary
from .routing_trace import ROUTING_TRACE


@dataclass(frozen=True)
class OffloadParams:
    """residency: shares of each actor's shards kept resident (1: no budget, the baseline); prefetch: modes per
    offloaded level; quant: expert quantisation modes, each against its own all-resident run; model: the benchmark
    model (its layer count replaced by `layers`); prefill / decode: the workloads timed."""

    residency: tuple[float, ...] = (1.0, 0.5, 0.25)
    prefetch: tuple[str, ...] = ("off", "gate")
    eviction: tuple[str, ...] = ("layer-cycle",)  # experts.eviction orders, one mesh per offloaded level each
    layers: int = 4
    quant: tuple[str, ...] = ("none", "int8", "int4")
    perplexity: bool = True
    # FIFO vs expert-affinity admission served on a two-topic workload (ops/bench/offload_affinity.py) in the first
    # offloaded mesh: AffinityWorkload's fields to override; None: skip.
    affinity: dict | None = field(default_factory=lambda: {"requests": AffinityWorkload().requests,
                                                           "topics": AffinityWorkload().topics})
    # A long decode on demand, with gate prefetch and with gate prefetch under its governor, in the first offloaded
    # mesh (ops/bench/offload_governor.py): GovernorWorkload's fields to override; None: skip.
    governor: dict | None = field(default_factory=lambda: {"steps": GovernorWorkload().steps,
                                                           "rounds": GovernorWorkload().rounds})
    ppl: dict = field(default_factory=dict)  # held_out_perplexity's tokens / window (default: its own)
    model: dict = field(default_factory=lambda: MIXTRAL)
    prefill: dict = field(default_factory=lambda: dict(sequences=2, tokens=128, repeats=3))
    decode: dict = field(default_factory=lambda: dict(sequences=16, context=32, steps=10))

    @classmethod
    def from_args(cls, args) -> OffloadParams:
        return cls(tuple(float(r) for r in args.residency.split(",")), tuple(args.prefetch_modes.split(",")),
                   eviction=tuple(args.evictions.split(",")), layers=args.layers, quant=tuple(args.quant.split(",")),
                   perplexity=not args.no_perplexity,
                   affinity=(dict(requests=args.affinity_requests, topics=args.affinity_topics)
                             if args.affinity_requests else None),
                   governor=(dict(steps=args.governor_steps, rounds=args.governor_rounds) if args.governor_steps
                             else None),
                   decode=dict(sequences=args.decode_sequences, context=32, steps=args.decode_steps))


def run_offload_bench(params: OffloadParams = OffloadParams(), verbose: bool = True,
                      config: MeshConfig | None = None) -> dict:
    from ...experts.checkpoint import CheckpointReader
    from ...experts.weights import load_expert_shards
    from ...router_service.mesh import ExpertMesh

    say = say_to_stderr(verbose)
    prefetch, quant, prefill, decode = params.prefetch, params.quant, params.prefill, params.decode
    config = (config or MeshConfig()).replace(**{"controller.enabled": False, "model.dtype": "float32"})
    if config.experts.layout == "auto":
        # One actor per expert, hosting expert e of every layer, so "50 %" is half of what each of 8 actors hosts.
        # (`auto` on a small box puts all 32 shards in one actor; the per-actor share below would then be wrong.)
        config = config.replace(**{"experts.layout": "per-expert"})
    if config.router.transport == "compiled":
        prefetch = tuple(m for m in prefetch if m == "off")  # compiled graphs' actors take no prefetch calls
    all_cores()
    model = dict(params.model, layers=params.layers)
    result: dict = {"benchmark": "offload", "model": model, "prefill": prefill, "decode": decode,
                    "transport": config.router.transport, "layout": config.experts.layout, "runs": [],
                    "machine": machine_info()}
    gen = torch.Generator().manual_seed(0)
    prefill_ids = torch.randint(0, model["vocab"], (prefill["sequences"], prefill["tokens"]), generator=gen)
    context_ids = torch.randint(0, model["vocab"], (decode["sequences"], decode["context"]), generator=gen)
    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-") as tmp:
        say("writing benchmark checkpoint ...")
        model_dir = write_bench_checkpoint(Path(tmp) / "model", model)
        reader = CheckpointReader(model_dir)
        per_actor = len(reader.config.moe_layers)  # per-expert layout: expert e of every MoE layer per actor
        if config.experts.layout != "per-expert":
            raise ValueError(f"experts.layout: bench offload sizes budgets for the per-expert layout, got "
                             f"{config.experts.layout!r}")
        result["shard_bytes"] = {}
        for q in quant:
            base = config.replace(**{"model.path": str(model_dir)})
            if q != "none":
                base = base.replace(**{"experts.quant": q})  # issue 15 item 3's field
            baseline: dict | None = None  # each quantisation mode against its own all-resident run
            # Budgets in this mode's shard size: a quantised shard is ~1/4 (int8) or ~1/8 (int4) of a float32 one.
            shard_bytes = load_expert_shards(reader, [(0, 0)], quant=q)[(0, 0)].nbytes()
            result["shard_bytes"][q] = shard_bytes
            first_run = len(result["runs"])
            for share in params.residency:
                keep = max(1, round(share * per_actor))
                offload = keep < per_actor
                for eviction in (params.eviction if offload else (None,)):
                    mesh_config = (base.replace(**{"experts.memory_gb": keep * shard_bytes / 2**30,
                                                   "experts.eviction": eviction}) if offload else base)
                    say(f"quant {q}, residency {share:.0%} ({keep}/{per_actor} shards per actor)"
                        f"{f', eviction {eviction}' if offload else ''}: starting actors ...")
                    with ExpertMesh(mesh_config) as mesh:
                        for mode in (prefetch if offload else ("off",)):
                            say(f"  prefetch {mode} ...")
                            run = _run(mesh, mode, prefill_ids, context_ids, baseline, params)
                            run |= {"quant": q, "residency": share, "resident_shards_per_actor": keep,
                                    "eviction": eviction}
                            if baseline is None:
                                baseline = run
                            result["runs"].append({k: v for k, v in run.items() if not k.startswith("_")})
                        if offload and params.affinity is not None and "affinity" not in result:
                            workload = AffinityWorkload(**params.affinity)
                            say(f"  FIFO vs affinity admission, {workload.requests} requests on {workload.topics} "
                                "topics ...")
                            result["affinity"] = serve_fifo_vs_affinity(mesh, _actor_totals, workload) | {
                                "residency": share, "eviction": eviction, "quant": q}
                        if offload and params.governor is not None and "governor" not in result \
                                and "gate" in prefetch:
                            workload = GovernorWorkload(**params.governor)
                            say(f"  on demand vs gate prefetch vs gate prefetch governed, {workload.steps} decode "
                                f"steps x {workload.rounds} rounds ...")
                            result["governor"] = decode_with_and_without_governor(mesh, context_ids, workload) | {
                                "residency": share, "eviction": eviction, "quant": q}
            if baseline is not None and baseline["residency"] >= 1.0:
                # The resident mesh once more at the end: on a shared machine the load drifts over minutes, so
                # the ratios use the better of the two resident runs (both are reported).
                say(f"quant {q}, residency 100 % again ...")
                with ExpertMesh(base) as mesh:
                    again = _run(mesh, "off", prefill_ids, context_ids, baseline, params)
                result.setdefault("resident_again", {})[q] = {k: v for k, v in again.items() if not k.startswith("_")}
                rebase_on_best_resident(result["runs"][first_run:], again)
    if params.perplexity:
        say("held-out perplexity of the embedded model, resident in process and offloaded through actors ...")
        result["perplexity"] = _perplexity(quant, config, params.ppl)
    result["stall_removed_by_prefetch"] = stall_removed_by_prefetch(result["runs"])
    result["policy_simulation"] = simulate_recorded_trace(params.eviction)
    result["affinity_simulation"] = simulate_affinity()
    return result


def simulate_affinity() -> list[dict] | None:
    """FIFO against expert-affinity admission (router_service/affinity.py) replayed on the recorded trace: 16
    requests (one per held-out file), 16-token prompts, 32 decoded tokens, 4 slots, 50 % residency."""
    import json

    from ...router_service.affinity_sim import simulate_admission

    if not ROUTING_TRACE.is_file():
        return None
    trace = json.loads(ROUTING_TRACE.read_text())
    return [simulate_admission(trace, admission, batch=4, gap=gap, signature_size=size)
            for gap in (0.0, 2.0) for admission, size in (("fifo", None), ("affinity", None), ("affinity", 4))]


def simulate_recorded_trace(evictions: tuple[str, ...]) -> dict | None:
    """The eviction orders (every one, the benchmark's marked) replayed on the embedded model's recorded routing
    trace (experts/eviction_sim.py): demand loads and shards moved at 50 % / 25 % residency, on demand and with
    gate prefetch, at batch 16 (the decode workload's) and 4."""
    import json

    from ...experts.eviction_sim import compare_policies
    from ...experts.setting_choices import EVICTION_POLICIES

    if not ROUTING_TRACE.is_file():
        return None  # installed without the repository's docs
    trace = json.loads(ROUTING_TRACE.read_text())
    keys = ("policy", "share", "batch", "prefetch", "calls", "demand_loads", "shards_moved", "needed_evictions",
            "hit_rate", "prefetch_precision")
    rows = compare_policies(trace, EVICTION_POLICIES, (0.5, 0.25), (16, 4))
    return {"trace": str(ROUTING_TRACE.relative_to(ROUTING_TRACE.parents[4])), "benchmarked": list(evictions),
            "rows": [{k: r[k] for k in keys} for r in rows]}


def _run(mesh, mode: str, prefill_ids: torch.Tensor, context_ids: torch.Tensor, baseline: dict | None,
         params: OffloadParams) -> dict:
    from ...router_service.prefetch import NextLayerPredictor
    from ...router_service.prefetch_policy import PrefetchPolicy

    # "gate:0.3": gate prefetch hinting only experts some token gives ≥ 0.3 (experts.prefetch_min_confidence)
    base_mode, _, confidence = mode.partition(":")
    policy = PrefetchPolicy(min_confidence=float(confidence or 0.0))
    mesh.backend.prefetcher = (None if mode == "off" else
                               NextLayerPredictor(base_mode, mesh.model_config.moe_layers, mesh.model.predict_experts,
                                                  policy=policy, gate_probs=mesh.model.predict_expert_probs,
                                                  top_k=mesh.model_config.top_k))
    rows = list(prefill_ids)
    mesh.model.forward(rows)  # warm-up
    before = _actor_totals(mesh)
    times = []
    for _ in range(params.prefill["repeats"]):
        started = time.perf_counter()
        prefill_logits = mesh.model.forward(rows)
        times.append(time.perf_counter() - started)
    prefill_s = min(times)
    prefill_tiers = counter_delta(before, _actor_totals(mesh))

    caches = [mesh.model.new_cache() for _ in range(len(context_ids))]
    out = mesh.model.forward(list(context_ids), caches)
    # The same tokens in every run: the all-resident run's greedy picks (so logits compare one for one).
    feed = (baseline["_feed"] if baseline is not None else
            [torch.stack([x[-1] for x in out]).argmax(-1)])
    if mesh.backend.prefetcher is not None:
        mesh.backend.prefetcher.predicted = mesh.backend.prefetcher.actual = mesh.backend.prefetcher.hits = 0
    before = _actor_totals(mesh)
    step_times, logits = [], []
    for step in range(params.decode["steps"]):
        next_ids = feed[step]
        started = time.perf_counter()
        out = mesh.model.forward([t.view(1) for t in next_ids], caches)
        step_times.append(time.perf_counter() - started)
        logits.append(torch.stack([x[-1] for x in out]))
        if baseline is None:
            feed.append(logits[-1].argmax(-1))
    decode_s = min(step_times)  # best step: the least disturbed by other work on a shared machine
    decode_tiers = counter_delta(before, _actor_totals(mesh))

    run = {
        "prefetch": mode,
        "prefill_tokens_per_s": round(prefill_ids.numel() / prefill_s, 1),
        "decode_tokens_per_s": round(len(context_ids) / decode_s, 1),
        # The mean over every timed step: at batch 16 every step calls every expert, so the best step is
        # representative; with a few sequences steps differ in how many of their shards were resident, and only
        # the mean counts the unlucky ones.
        "decode_mean_tokens_per_s": round(len(context_ids) * len(step_times) / sum(step_times), 1),
        "prefill_tiers": tier_summary(prefill_tiers),
        "decode_tiers": tier_summary(decode_tiers),
        "prefetch_prediction": None if mesh.backend.prefetcher is None else mesh.backend.prefetcher.stats(),
        "_feed": feed, "_prefill_logits": prefill_logits, "_decode_logits": logits,
    }
    if baseline is not None:
        run["prefill_vs_resident"] = round(run["prefill_tokens_per_s"] / baseline["prefill_tokens_per_s"], 3)
        run["decode_vs_resident"] = round(run["decode_tokens_per_s"] / baseline["decode_tokens_per_s"], 3)
        run["decode_mean_vs_resident"] = round(run["decode_mean_tokens_per_s"] /
                                               baseline["decode_mean_tokens_per_s"], 3)
        same = all(torch.equal(a, b) for a, b in zip(prefill_logits, baseline["_prefill_logits"]))
        same = same and all(torch.equal(a, b) for a, b in zip(logits, baseline["_decode_logits"]))
        run["bit_identical_to_resident"] = bool(same)
    return run


def _perplexity(quant: tuple[str, ...], config: MeshConfig, ppl: dict) -> dict:
    """{mode: {"resident", "offloaded", "identical", ...}} on the embedded model (see the module docstring)."""
    from ...experts.checkpoint import CheckpointReader
    from ...experts.embedded_model import EMBEDDED_MODEL_DIR
    from ...experts.reference import load_reference_model
    from ...experts.weights import load_expert_shards
    from ...router_service.mesh import ExpertMesh
    from ..perplexity import held_out_perplexity

    reader = CheckpointReader(EMBEDDED_MODEL_DIR)
    first = (reader.config.moe_layers[0], 0)
    out = {}
    for q in quant:
        resident = held_out_perplexity(load_reference_model(EMBEDDED_MODEL_DIR, torch.float32, quant=q), **ppl)
        shard_bytes = load_expert_shards(reader, [first], quant=q)[first].nbytes()  # this mode's shard size
        mesh_config = config.replace(**{"model.path": str(EMBEDDED_MODEL_DIR), "experts.quant": q,
                                        "experts.prefetch": "gate"})
        with ExpertMesh(mesh_config) as mesh:  # how many shards the layout gives each actor here
            hosted = min(len(info["shards"]) for info in mesh.actor_info())
        keep = max(1, hosted // 2)
        with ExpertMesh(mesh_config.replace(**{"experts.memory_gb": keep * shard_bytes / 2**30})) as mesh:
            offloaded = held_out_perplexity(mesh, **ppl)
            tiers = [info.get("tiers") or {} for info in mesh.actor_info()]
        misses, moved = (sum(t.get(key, 0) for t in tiers) for key in ("misses", "bytes_moved"))
        out[q] = {"resident": round(resident["perplexity"], 4), "offloaded": round(offloaded["perplexity"], 4),
                  "identical": resident["loss"] == offloaded["loss"], "tokens_scored": resident["tokens_scored"],
                  "offloaded_residency": round(keep / hosted, 3), "offloaded_misses": int(misses),
                  "offloaded_bytes_moved": int(moved)}
    return out


def _actor_totals(mesh) -> dict:
    totals = dict.fromkeys(TIER_KEYS, 0.0) | {"compute_s": 0.0}
    for info in mesh.actor_info():
        totals["compute_s"] += info.get("compute_s", 0.0)
        for key in TIER_KEYS:
            totals[key] += (info.get("tiers") or {}).get(key, 0)
    return totals
