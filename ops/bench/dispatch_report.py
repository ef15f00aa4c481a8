"""How `expertmesh bench dispatch` turns timed forwards into its report (pure: no torch, no Ray, no mesh); checked on
crafted timings in tests/unit/test_bench_reports.py."""

from __future__ import annotations

import statistics


def forward_summary(tokens: int, hf_times: list[float], mesh_times: list[float], rounds: list[float], delta: float,
                    compute: list[float], layers: int, cores: int) -> dict:
    """One workload's figures from its timed repeats (seconds per forward): tokens/s of both, eta (transformers' time
    over ours), the expert rounds' wall time per layer and what of it is not the experts' own compute."""
    hf_s, mesh_s, round_s = statistics.median(hf_times), statistics.median(mesh_times), statistics.median(rounds)
    compute_s = statistics.median(compute)
    # The experts' own work in a round: their CPU time spread over the cores the actors share (the router waits
    # during a round). What a round takes beyond it is the transport's: serialisation, calls, scheduling, waits.
    compute_wall_s = compute_s / cores
    return {
        "tokens_per_forward": tokens,
        "transformers_tokens_per_s": round(tokens / hf_s, 2),
        "expertmesh_tokens_per_s": round(tokens / mesh_s, 2),
        "eta": round(hf_s / mesh_s, 4),
        "transformers_forward_s": round(hf_s, 5),
        "expertmesh_forward_s": round(mesh_s, 5),
        "expertmesh_expert_rounds_s": round(round_s, 5),  # wall time in the per-layer expert rounds
        "expertmesh_dense_s": round(mesh_s - round_s, 5),
        "expert_compute_cpu_s": round(compute_s, 5),  # summed over actors, per forward
        "per_layer_round_ms": round(1000 * round_s / layers, 3),
        "per_layer_overhead_ms": round(1000 * max(0.0, round_s - compute_wall_s) / layers, 3),
        "max_abs_logit_diff": delta,
    }


def with_noop_floor(summary: dict, noop_round_ms: float) -> dict:
    """The per-layer overhead as a multiple of Ray's floor (one no-op call to every actor, all in flight)."""
    summary["overhead_vs_noop_floor"] = round(summary["per_layer_overhead_ms"] / noop_round_ms, 3)
    return summary
