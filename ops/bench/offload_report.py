"""How `expertmesh bench offload` turns its runs into the report (pure: no torch, no Ray, no mesh): the tier counters'
deltas and summaries, the ratios against the faster of two all-resident runs, and the share of on-demand stall that
prefetch removed. Checked on crafted runs in tests/unit/test_bench_offload_report.py."""

from __future__ import annotations

TIER_KEYS = ("hits", "misses", "bytes_moved", "stall_s", "prefetch_issued", "prefetch_useful")


def rebase_on_best_resident(runs: list[dict], again: dict) -> None:
    """Ratios against the faster of the two all-resident runs, per workload."""
    first = runs[0]
    rates = ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_mean_tokens_per_s")
    best = {k: max(first[k], again[k]) for k in rates if k in first and k in again}
    for run in runs:
        run["prefill_vs_resident"] = round(run["prefill_tokens_per_s"] / best["prefill_tokens_per_s"], 3)
        run["decode_vs_resident"] = round(run["decode_tokens_per_s"] / best["decode_tokens_per_s"], 3)
        if "decode_mean_tokens_per_s" in best:  # results written before the mean was recorded lack it
            run["decode_mean_vs_resident"] = round(run["decode_mean_tokens_per_s"] /
                                                   best["decode_mean_tokens_per_s"], 3)


def counter_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def tier_summary(d: dict) -> dict:
    asked = d["hits"] + d["misses"]
    return {"hit_rate": round(d["hits"] / asked, 3) if asked else None,
            "stall_s": round(d["stall_s"], 4),
            "stall_share": round(d["stall_s"] / d["compute_s"], 3) if d["compute_s"] else None,
            "bytes_moved": int(d["bytes_moved"]), "prefetch_issued": int(d["prefetch_issued"]),
            "prefetch_useful": int(d["prefetch_useful"])}


def stall_removed_by_prefetch(runs: list[dict]) -> list[dict]:
    """Per (quant, residency, eviction): 1 - decode stall with prefetch / decode stall on demand."""
    out = []
    for run in runs:
        if run["prefetch"] == "off" or run["residency"] >= 1.0:
            continue
        off = next((r for r in runs if r["prefetch"] == "off" and r["residency"] == run["residency"]
                    and r["quant"] == run["quant"] and r.get("eviction") == run.get("eviction")), None)
        if off is None or not off["decode_tiers"]["stall_s"]:
            continue
        out.append({"quant": run["quant"], "residency": run["residency"], "prefetch": run["prefetch"],
                    "eviction": run.get("eviction"),
                    "decode_stall_removed": round(1 - run["decode_tiers"]["stall_s"] / off["decode_tiers"]["stall_s"],
                                                  3)})
    return out
