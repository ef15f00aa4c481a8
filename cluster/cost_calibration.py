"""The CPU profile of the latency model, fitted from `expertmesh bench dispatch --workload decode --json`, and the
check of a prediction against another run. Pure: reads the bench's JSON dict, imports no torch or Ray.

What is fitted (the bench's Mixtral-like model, 8 actors, T sequences at C context; one decode run, or two at
different batch sizes for the fixed costs that a single batch cannot separate from the per-token ones):
  dense rate     the router's dense FLOP of a step (cost_model.dense_step_flops) / expertmesh_dense_s; with two runs
                 the slope, and the rest a fixed cost per eager op (op_overhead_s x DENSE_OPS_PER_LAYER per layer)
  expert rate    the experts' FLOP (cost_model.expert_layer_flops x layers) / expert_compute_cpu_s, their summed
                 CPU-seconds; with two runs CPU-seconds = hit shards x shard bytes / read rate + FLOP / rate, solved
                 for both (a call streams its expert's weights from memory: at 8 sequences that is most of it)
  transport      the empty round (transport_round_ms: one call to every actor, nothing to compute) / actors, per
                 call: on 2 cores the calls serialise
  parallelism    cores' worth the actors get together: their CPU-seconds per layer / (round - plan - transport -
                 combine); below the core count when 8 actor processes share 2 cores (two runs: their mean)
The plan constants (cost_profiles.PLAN_*) come from `bench dispatch-overhead`, not from this run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .cost_model import (
    Layout,
    Profile,
    StepShape,
    dense_step_flops,
    expected_hit,
    expert_layer_flops,
    moe_layer_time,
    predict_step,
)
from .cost_profiles import (
    CPU_BASE,
    DENSE_OPS_PER_LAYER,
    TransportProfile,
    bench_shape,
)

BENCH_CONTEXT = 64  # ops/bench/dispatch.py DispatchParams.decode: 32 sequences with 64 tokens of context


@dataclass(frozen=True)
class CpuFit:
    profile: Profile  # the bench model on this CPU, as fitted
    step: StepShape  # the decode step the run timed
    fitted: dict  # the constants, for the docs and the JSON


def calibrate_cpu(bench: dict, context: int | None = None, second: dict | None = None) -> CpuFit:
    """The CPU profile (and the bench model's Profile) from one bench dispatch result with a "decode" section, or
    from two (`second`: the same bench, model and transport at another batch size), which also fits the fixed
    costs. context: the decode workload's; default what the JSON records ("decode_workload"), else the bench's 64."""
    runs = [bench] + ([second] if second is not None else [])
    for run in runs:
        if "decode" not in run:
            raise ValueError("calibrate_cpu: the bench JSON has no 'decode' section (run --workload decode or both)")
    m = bench_shape(bench["model"])
    actors = m.num_experts  # the bench's layout on a CPU box: one actor per expert
    layout = Layout(devices=1, actors=actors, expert_bytes=4.0, act_bytes=4.0)  # the bench runs float32
    per_call = bench["transport_round_ms"] / 1000 / actors
    transport = TransportProfile(f"{bench['transport']} (this CPU)", per_call, per_call, host_copies=0,
                                 device_direct=False, syncs=0, source="fitted: transport_round_ms / actors")
    points = [_point(run, m, _context(run, context)) for run in runs]
    n, context = points[0]["n"], points[0]["context"]
    dense_rate = points[0]["dense_flops"] / points[0]["dense_s"]
    expert_rate = points[0]["expert_flops"] / points[0]["expert_cpu_s"]
    op_s, read_bw = 0.0, math.inf
    if second is not None:
        if bench_shape(second["model"]) != m or second["transport"] != bench["transport"]:
            raise ValueError("calibrate_cpu: the two runs benchmarked another model or transport")
        a, b = points
        if a["n"] == b["n"]:
            raise ValueError("calibrate_cpu: the two runs must decode different batch sizes")
        ops = m.num_layers * DENSE_OPS_PER_LAYER + 4  # every layer's eager dense ops + the lm_head's (cost_model)
        slope = (a["dense_flops"] - b["dense_flops"]) / (a["dense_s"] - b["dense_s"])
        fixed = a["dense_s"] - a["dense_flops"] / slope
        if slope > 0 and fixed >= 0:  # else the runs disagree (a loaded box): keep the one-run rate
            dense_rate, op_s = slope, fixed / ops
        # hit x S x (1/bw) + X x (1/rate) = CPU-s, for both runs (Cramer's rule on the 2 x 2 system)
        det = a["read_bytes"] * b["expert_flops"] - b["read_bytes"] * a["expert_flops"]
        inv_bw = (a["expert_cpu_s"] * b["expert_flops"] - b["expert_cpu_s"] * a["expert_flops"]) / det if det else -1
        inv_rate = (a["read_bytes"] * b["expert_cpu_s"] - b["read_bytes"] * a["expert_cpu_s"]) / det if det else -1
        if inv_bw > 0 and inv_rate > 0:
            read_bw, expert_rate = 1 / inv_bw, 1 / inv_rate
    hw = replace(CPU_BASE, name=f"cpu ({bench.get('machine', {}).get('cpus', '?')} cores, fitted)",
                 flops=dense_rate, op_overhead_s=op_s, expert_flops_per_cpu_s=expert_rate, expert_read_bw=read_bw)
    parallelism = [_parallelism(Profile(m, hw, transport, layout), point) for point in points]
    hw = replace(hw, cpu_parallelism=sum(parallelism) / len(parallelism))
    fitted = {"dense_flops_per_s": hw.flops, "dense_op_overhead_s": op_s,
              "expert_flops_per_cpu_s": hw.expert_flops_per_cpu_s, "expert_read_bytes_per_s": read_bw,
              "cpu_parallelism": hw.cpu_parallelism, "cpu_parallelism_per_run": parallelism,
              "transport_per_call_s": per_call, "transport": bench["transport"], "sequences": n,
              "sequences_per_run": [p["n"] for p in points], "context": context,
              "transformers_forward_s": bench["decode"]["transformers_forward_s"]}
    return CpuFit(Profile(m, hw, transport, layout), StepShape(n, n, context), fitted)


def _point(bench: dict, m, context: int) -> dict:
    """One run's measured decode step, with the FLOP and weight bytes the model charges for it."""
    d = bench["decode"]
    n = int(d["tokens_per_forward"])
    hit = min(m.num_experts, expected_hit(m.num_experts, m.top_k, n))
    return {"n": n, "context": context, "dense_s": d["expertmesh_dense_s"],
            "dense_flops": dense_step_flops(m, n, context),
            "expert_cpu_s": d["expert_compute_cpu_s"] / m.moe_layer_count, "expert_flops": expert_layer_flops(m, n),
            "read_bytes": hit * m.shard_params * 4.0, "round_s": d["per_layer_round_ms"] / 1000}


def _parallelism(p: Profile, point: dict) -> float:
    """Cores' worth the actors got in one run: their CPU-seconds per layer / the round's time left for them."""
    layer = moe_layer_time(p, StepShape(point["n"], point["n"], point["context"]))
    busy = max(point["round_s"] - layer.plan - layer.transport - layer.combine, 1e-9)
    return point["expert_cpu_s"] / busy


def _context(bench: dict, context: int | None) -> int:
    return context if context is not None else int(bench.get("decode_workload", {}).get("context", BENCH_CONTEXT))


def check_prediction(fit: CpuFit, bench: dict, context: int | None = None) -> dict:
    """The fitted profile's decode step against another run's measured one (its batch may differ):
    {predicted_s, measured_s, error (relative), within_25}. At the calibration's batch it also reports the run's
    load factor (transformers' forward in that run over the calibration run's: both runs time transformers on the
    same weights and batch, alternating with expertmesh, so the ratio is how much slower the box was) and the error
    of the prediction scaled by it: a loaded box slows every process, which a fit on a quiet box cannot know."""
    d = bench["decode"]
    n = int(d["tokens_per_forward"])
    context = _context(bench, context)
    model = bench_shape(bench["model"])
    if model != fit.profile.model:
        raise ValueError("check_prediction: the run benchmarked another model than the calibration run")
    predicted = predict_step(fit.profile, StepShape(n, n, context), overlap=bool(bench.get("overlap"))).step_s
    measured = d["expertmesh_forward_s"]
    error = predicted / measured - 1
    out = {"sequences": n, "predicted_s": round(predicted, 5), "measured_s": measured, "error": round(error, 4),
           "within_25": abs(error) <= 0.25}
    if n == fit.fitted["sequences"]:
        load = d["transformers_forward_s"] / fit.fitted["transformers_forward_s"]
        out |= {"load_factor": round(load, 3), "error_load_adjusted": round(predicted * load / measured - 1, 4)}
    return out
