"""`expertmesh bench offload` end to end on a shrunk benchmark model (hidden 64 instead of 1024, same code path):
each quantisation mode is compared with its own all-resident run, offloaded runs give the resident run's logits
bit for bit, prefetch reports recall and the stall it removed, and the embedded model's held-out perplexity is the
same resident in process and offloaded through actors."""

from __future__ import annotations

import pytest

from expertmesh.ops.bench.checkpoints import MIXTRAL
from expertmesh.ops.bench.dispatch import DispatchParams, run_dispatch_bench
from expertmesh.ops.bench.offload import OffloadParams, run_offload_bench

# The benchmark model shrunk: the same code path, seconds instead of minutes.
SMALL = dict(MIXTRAL, hidden=64, inter=128, heads=4, kv_heads=2, vocab=256)

pytestmark = pytest.mark.usefixtures("local_ray")


def test_offload_bench_reports_each_mode_against_its_own_resident_run():
    # Fewer tokens than the benchmark's (its figures need them, the code path does not), and one quant mode: int8
    # takes every step float does plus the packed weights (test_offload.py serves float offloaded; the int8 perplexity
    # bound against float is tests/unit/test_quant_models.py's). Each mode is five meshes: two minutes of CI.
    params = OffloadParams(residency=(1.0, 0.5), prefetch=("off", "gate"), layers=2, quant=("int8",),
                           ppl=dict(tokens=512, window=128), model=SMALL,
                           prefill=dict(sequences=2, tokens=32, repeats=1),
                           decode=dict(sequences=4, context=8, steps=4),
                           affinity=dict(requests=4, prompt=4, max_tokens=4, max_active=2, rounds=1),
                           governor=dict(steps=6, rounds=1, window_steps=2, pairs=1, hold_steps=100))
    result = run_offload_bench(params, verbose=False)
    assert result["layout"] == "per-expert"  # budgets are shares of what each of the per-expert actors hosts
    runs = result["runs"]
    assert [(r["quant"], r["residency"], r["prefetch"]) for r in runs] == [
        ("int8", 1.0, "off"), ("int8", 0.5, "off"), ("int8", 0.5, "gate")]
    for run in runs:
        if run["residency"] < 1.0:
            assert run["eviction"] == "layer-cycle"  # the default order, one mesh per offloaded level
            assert run["bit_identical_to_resident"], run  # int8 against int8's resident run, not float's
            assert run["decode_tiers"]["bytes_moved"] > 0 and run["decode_vs_resident"] > 0
    gate = [r for r in runs if r["prefetch"] == "gate"]
    assert all(r["prefetch_prediction"]["recall"] > 0.5 for r in gate)
    assert set(result["resident_again"]) == {"int8"}
    assert result["policy_simulation"]["rows"] and result["affinity_simulation"]  # the recorded-trace replays
    assert {s["quant"] for s in result["stall_removed_by_prefetch"]} <= {"int8"}
    # FIFO vs expert-affinity admission served on the two-topic burst, in the first offloaded mesh: same tokens,
    # fewer shards called per request (the two topics' experts are disjoint halves)
    affinity = result["affinity"]
    assert (affinity["residency"], affinity["quant"]) == (0.5, "int8")
    assert affinity["summary"]["same_tokens"], affinity
    assert affinity["summary"]["shard_calls_fewer_x"] >= 1.3, affinity
    # The long decode on demand / gate / gate governed: same tokens, and the governor measured and decided (2-step
    # windows, one pair: after 4 decode steps) through the real dispatcher's step timing.
    governor = result["governor"]
    assert [r["mode"] for r in governor["runs"]] == ["off", "gate", "gate+governor"], governor
    assert governor["summary"]["all_tokens_equal"], governor
    governed = governor["runs"][2]["governor"]
    assert governed["measurements"] == 1 and not governed["measuring"] and len(governed["verdicts"]) == 1, governed
    ppl = result["perplexity"]
    assert set(ppl) == {"int8"}
    for row in ppl.values():
        assert row["identical"] and row["resident"] == row["offloaded"]
        # Shards really moved. Not "misses > 0": gate prefetch riding with the calls can load every shard in time
        # over a few long prefill windows (measured: 0 or 2 misses in three runs of this test's 512 tokens).
        assert row["offloaded_bytes_moved"] > 0 and row["offloaded_residency"] <= 0.5


def test_dispatch_bench_counts_the_routers_device_reads_per_moe_layer():
    """`expertmesh bench dispatch` runs the router's step on a fake GPU against the live actors and reports its
    device reads: one wait per MoE layer at decode and at prefill, nothing else (README: The router on a GPU)."""
    params = DispatchParams(workload="decode", repeats=1, shape="small", model=dict(SMALL, layers=2),
                            decode=dict(sequences=4, context=8))
    result = run_dispatch_bench(params, verbose=False)
    reads = result["device_reads"]
    for phase in ("prefill", "decode"):
        assert reads[phase]["moe_layers"] == 2
        assert reads[phase]["waits_per_moe_layer"] == 1.0, reads[phase]
        assert reads[phase]["reads_per_moe_layer"] == 1.0, reads[phase]["sites"]
    assert result["decode"]["max_abs_logit_diff"] <= 1e-4
    # One call through the transport against a plain Ray call with the same rows (the cost model's rdt input).
    one = result["one_call_ms"]
    assert one["transport"] > 0 and one["ray_call_inline"] > 0 and one["rows"] == 8
    assert one["extra_ms"] == round(one["transport"] - one["ray_call_inline"], 3)
