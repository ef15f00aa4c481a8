"""`expertmesh bench shed` and `bench quant` run end to end at a small size (in process, no Ray): the JSON has the
fields the README's tables are read from, and its figures are consistent with each other. Timing is not checked
(benchmarks, not tests, measure speed)."""

from __future__ import annotations

from expertmesh.ops.bench.quant import QuantParams, run_quant_bench
from expertmesh.ops.bench.shed import ShedParams, run_shed_bench


def test_shed_bench_sheds_the_hot_expert_and_counts_every_moved_slot():
    result = run_shed_bench(ShedParams(streams=6, max_tokens=12, capacity=2, window_s=0.05, call_ms=0.2,
                                       per_token_ms=0.5, ppl_tokens=512, rounds=1), verbose=False)
    assert result["shed_counted_per_response_equals_dispatcher"]
    off, on = result["phases"]["off"], result["phases"]["on"]
    assert on["shed_slots_dispatcher"] > 0 and off["shed_slots_dispatcher"] == 0
    cost = result["quality"]["unbiased_model_cap_on_busiest_expert"]
    assert cost["perplexity_shedding"] > cost["perplexity"] > 1  # moving tokens off their first choice costs


def test_quant_bench_reports_perplexity_bytes_and_kernels_per_mode():
    params = QuantParams(tokens=512, repeats=1, modes=("none", "int8", "int4"),
                         big_shape=dict(hidden=128, inter=256, experts=4, top_k=2))
    result = run_quant_bench(params, verbose=False)
    modes = result["modes"]
    assert modes["none"]["max_abs_dlogit"] == 0.0
    for mode, share in (("int8", 0.5), ("int4", 0.25)):
        row = modes[mode]
        assert 0 < row["max_abs_dlogit"] and row["top1_agreement"] > 0.5
        assert row["expert_bytes_bf16"] <= modes["none"]["expert_bytes_bf16"] * share * 1.2  # ± scales
        assert row["compute"]["bfloat16"]["model_shape"]["kernels"]
    assert abs(modes["int8"]["perplexity"] / modes["none"]["perplexity"] - 1) < 0.01
