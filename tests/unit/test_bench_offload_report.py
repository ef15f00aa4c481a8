"""`bench offload`'s report assembly on crafted runs (ops/bench/offload_report.py): no mesh, no Ray."""

from __future__ import annotations

from expertmesh.ops.bench.offload_report import (
    counter_delta,
    rebase_on_best_resident,
    stall_removed_by_prefetch,
    tier_summary,
)


def _run(quant: str, residency: float, prefetch: str, stall_s: float, prefill: float = 100.0,
         decode: float = 10.0, eviction: str | None = "lru") -> dict:
    return {"quant": quant, "residency": residency, "prefetch": prefetch, "eviction": eviction,
            "prefill_tokens_per_s": prefill,
            "decode_tokens_per_s": decode, "decode_tiers": {"stall_s": stall_s}}


def test_ratios_use_the_faster_resident_run_per_workload():
    runs = [_run("none", 1.0, "off", 0, prefill=100, decode=10), _run("none", 0.5, "off", 1, prefill=60, decode=4)]
    again = {"prefill_tokens_per_s": 80.0, "decode_tokens_per_s": 16.0}  # prefill slower, decode faster the 2nd time
    rebase_on_best_resident(runs, again)
    assert [(r["prefill_vs_resident"], r["decode_vs_resident"]) for r in runs] == [(1.0, 0.625), (0.6, 0.25)]
    assert all("decode_mean_vs_resident" not in r for r in runs)  # older results carry no mean


def test_mean_decode_ratio_rebases_on_the_faster_resident_mean():
    runs = [_run("none", 1.0, "off", 0, decode=10) | {"decode_mean_tokens_per_s": 8.0},
            _run("none", 0.5, "off", 1, decode=9) | {"decode_mean_tokens_per_s": 5.0}]
    again = {"prefill_tokens_per_s": 80.0, "decode_tokens_per_s": 9.0, "decode_mean_tokens_per_s": 10.0}
    rebase_on_best_resident(runs, again)
    # best step: the first resident run (10); mean: the second (10), so the offloaded run is 0.9x and 0.5x
    assert [(r["decode_vs_resident"], r["decode_mean_vs_resident"]) for r in runs] == [(1.0, 0.8), (0.9, 0.5)]


def test_tier_summary_rates_and_shares():
    delta = counter_delta({"hits": 2, "misses": 1, "bytes_moved": 10, "stall_s": 0.5, "prefetch_issued": 0,
                           "prefetch_useful": 0, "compute_s": 1.0},
                          {"hits": 8, "misses": 3, "bytes_moved": 4106, "stall_s": 0.75, "prefetch_issued": 5,
                           "prefetch_useful": 4, "compute_s": 2.0})
    assert tier_summary(delta) == {"hit_rate": 0.75, "stall_s": 0.25, "stall_share": 0.25, "bytes_moved": 4096,
                                   "prefetch_issued": 5, "prefetch_useful": 4}
    idle = dict.fromkeys(delta, 0)
    assert tier_summary(idle)["hit_rate"] is None and tier_summary(idle)["stall_share"] is None


def test_stall_removed_pairs_each_prefetch_run_with_its_own_on_demand_run():
    runs = [_run("none", 1.0, "off", 0.0), _run("none", 0.5, "off", 2.0), _run("none", 0.5, "gate", 0.5),
            _run("int8", 1.0, "off", 0.0), _run("int8", 0.5, "off", 1.0), _run("int8", 0.5, "gate", 1.5),
            _run("int8", 0.25, "gate", 1.0)]  # no on-demand run at 25 %: left out, not paired with another level
    assert stall_removed_by_prefetch(runs) == [
        {"quant": "none", "residency": 0.5, "prefetch": "gate", "eviction": "lru", "decode_stall_removed": 0.75},
        {"quant": "int8", "residency": 0.5, "prefetch": "gate", "eviction": "lru",
         "decode_stall_removed": -0.5}]  # prefetch cost time


def test_stall_removed_pairs_within_one_eviction_order():
    runs = [_run("none", 0.5, "off", 2.0, eviction="lru"), _run("none", 0.5, "off", 1.0, eviction="layer-cycle"),
            _run("none", 0.5, "gate", 0.5, eviction="layer-cycle")]
    assert stall_removed_by_prefetch(runs) == [
        {"quant": "none", "residency": 0.5, "prefetch": "gate", "eviction": "layer-cycle",
         "decode_stall_removed": 0.5}]


def test_no_on_demand_stall_reports_nothing_rather_than_dividing_by_zero():
    assert stall_removed_by_prefetch([_run("none", 0.5, "off", 0.0), _run("none", 0.5, "gate", 0.1)]) == []


def test_policy_and_affinity_figures_from_the_recorded_trace_and_the_chart(tmp_path):
    from expertmesh.ops.bench.offload import simulate_affinity, simulate_recorded_trace
    from expertmesh.ops.bench.offload_chart import write_offload_chart

    sim = simulate_recorded_trace(("layer-cycle",))
    assert sim["benchmarked"] == ["layer-cycle"]
    assert {(r["policy"], r["share"], r["batch"], r["prefetch"]) for r in sim["rows"]} >= {
        ("lru", 0.5, 16, "off"), ("layer-cycle", 0.25, 4, "gate")}
    affinity = simulate_affinity()
    assert {r["admission"] for r in affinity} == {"fifo", "affinity"}
    runs = [_run("none", 0.5, "gate", 0.5) | {"decode_vs_resident": 0.7}]
    path = write_offload_chart({"policy_simulation": sim, "runs": runs}, tmp_path / "offload.png")
    assert path.stat().st_size > 1000
    affinity = {"workload": {"requests": 16}, "residency": 0.5, "runs": [
        {"admission": a, "round": 0, "demand_loads_per_request": d, "shard_calls_per_request": 2 * d,
         "latency_p99_s": 1.0} for a, d in (("fifo", 40.0), ("affinity", 20.0))]}
    path = write_offload_chart({"policy_simulation": sim, "runs": runs, "affinity": affinity}, tmp_path / "aff.png")
    assert path.stat().st_size > 1000
