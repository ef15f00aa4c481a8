"""The CPU profile of the latency model, fitted from `expertmesh bench dispatch --workload decode --json`, and the
check of a prediction against another run. Pure: reads the bench's JSON dict, imports no torch or Ray.

What is fitted (one decode run: the bench's Mixtral-like model, 8 actors, T sequences at C context):
  dense rate     the router's dense FLOP of a step (cost_model.dense_step_flops) / expertmesh_dense_s
  expert rate    the experts' FLOP (cost_model.expert_layer_flops x layers) / expert_compute_cpu_s, their summed
                 CPU-seconds
  transport      the empty round (transport_round_ms: one call to every actor, nothing to compute) / actors, per
                 call: on 2 cores the calls serialise
  parallelism    cores' worth the actors get together: their CPU-seconds per layer / (round - plan - transport);
                 below the core count when 8 actor processes share 2 cores
The plan constants (cost_profiles.PLAN_*) come from `bench dispatch-overhead`, not from this run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cost_model import Layout, Profile, StepShape, dense_step_flops, expected_hit, expert_layer_flops, predict_step
from .cost_profiles import (
    CPU_BASE,
    PLAN_FIXED_S,
    PLAN_PER_CALL_S,
    PLAN_PER_SLOT_S,
    TransportProfile,
    bench_shape,
)

BENCH_CONTEXT = 64  # ops/bench/dispatch.py DispatchParams.decode: 32 sequences with 64 tokens of context


@dataclass(frozen=True)
class CpuFit:
    profile: Profile  # the bench model on this CPU, as fitted
    step: StepShape  # the decode step the run timed
    fitted: dict  # the constants, for the docs and the JSON


def calibrate_cpu(bench: dict, context: int | None = None) -> CpuFit:
    """The CPU profile (and the bench model's Profile) from one bench dispatch result with a "decode" section.
    context: the decode workload's; default what the JSON records ("decode_workload"), else the bench's 64."""
    if "decode" not in bench:
        raise ValueError("calibrate_cpu: the bench JSON has no 'decode' section (run --workload decode or both)")
    context = _context(bench, context)
    d = bench["decode"]
    m = bench_shape(bench["model"])
    n = int(d["tokens_per_forward"])
    actors = m.num_experts  # the bench's layout on a CPU box: one actor per expert
    per_call = bench["transport_round_ms"] / 1000 / actors
    transport = TransportProfile(f"{bench['transport']} (this CPU)", per_call, per_call, host_copies=0,
                                 device_direct=False, syncs=0, source="fitted: transport_round_ms / actors")
    cpu_per_layer = d["expert_compute_cpu_s"] / m.moe_layer_count
    calls = min(actors, expected_hit(m.num_experts, m.top_k, n))
    plan = PLAN_FIXED_S + PLAN_PER_SLOT_S * n * m.top_k + PLAN_PER_CALL_S * calls
    busy = max(d["per_layer_round_ms"] / 1000 - plan - per_call * calls, 1e-9)
    hw = replace(CPU_BASE, name=f"cpu ({bench.get('machine', {}).get('cpus', '?')} cores, fitted)",
                 flops=dense_step_flops(m, n, context) / d["expertmesh_dense_s"],
                 expert_flops_per_cpu_s=expert_layer_flops(m, n) / cpu_per_layer,
                 cpu_parallelism=cpu_per_layer / busy)
    fitted = {"dense_flops_per_s": hw.flops, "expert_flops_per_cpu_s": hw.expert_flops_per_cpu_s,
              "cpu_parallelism": hw.cpu_parallelism, "transport_per_call_s": per_call,
              "transport": bench["transport"], "sequences": n, "context": context,
              "transformers_forward_s": d["transformers_forward_s"]}
    return CpuFit(Profile(m, hw, transport, Layout(devices=1, actors=actors, act_bytes=4.0)),
                  StepShape(n, n, context), fitted)


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
