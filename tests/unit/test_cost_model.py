"""The latency model (cluster/cost_model.py and its profiles, calibration, report and overlap policy): the CPU fit from
a recorded `bench dispatch` run, the per-step overlap choice on crafted profiles, layouts that fit, and
`plan-cluster --latency`. Pure: no Ray, no torch in the modules under test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from expertmesh.cluster.cost_calibration import calibrate_cpu, check_prediction
from expertmesh.cluster.cost_model import (
    EXPERT_BYTES,
    Layout,
    Profile,
    StepShape,
    moe_layer_time,
    node_layout,
    overlapped_layer_s,
    predict_step,
    should_overlap,
)
from expertmesh.cluster.cost_profiles import (
    CPU_BASE,
    GPUS,
    MODELS,
    TRANSPORTS,
    gpu_profile,
    gpu_transports,
    known_model,
)
from expertmesh.cluster.cost_report import prediction_rows, targets
from expertmesh.cluster.overlap_policy import StepOverlapPolicy, runtime_profile

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "results" / "bench" / "cost_model"
MIXTRAL, QWEN, DEEPSEEK = MODELS["mixtral-8x7b"], MODELS["qwen3-30b-a3b"], MODELS["deepseek-v3"]


def _bench(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _gpu(model=MIXTRAL, gpu="H100", transport="rdt", devices=7) -> Profile:
    return Profile(model, GPUS[gpu], gpu_transports()[transport], Layout(devices=devices, actors=devices))


# ---- CPU calibration ---------------------------------------------------------------------------------------------


def test_cpu_fit_reproduces_its_own_run_and_its_constants_are_physical():
    bench = _bench("calibration.json")
    fit = calibrate_cpu(bench)
    # Fitting and predicting share one set of formulas: the calibration run comes back within 1 %.
    check = check_prediction(fit, bench)
    assert abs(check["error"]) < 0.01, check
    f = fit.fitted
    assert 1e9 < f["dense_flops_per_s"] < 1e12 and 1e9 < f["expert_flops_per_cpu_s"] < 1e12  # a CPU, fp32
    assert 0.05 < f["cpu_parallelism"] <= bench["machine"]["cpus"]  # cores' worth the 8 actors got
    assert f["transport_per_call_s"] == pytest.approx(bench["transport_round_ms"] / 1000 / 8)
    # The step's parts: the expert rounds dominate on 2 cores, as measured.
    pred = predict_step(fit.profile, fit.step, overlap=False)
    d = bench["decode"]
    layer = pred.moe_layer  # the measured rounds hold plan, transport, expert and combine; dense_s the rest
    rounds = (layer.total - layer.router_dense) * fit.profile.model.moe_layer_count
    assert rounds == pytest.approx(d["expertmesh_expert_rounds_s"], rel=0.02)


def test_cpu_fit_refuses_a_run_without_decode_and_another_model():
    bench = _bench("calibration.json")
    with pytest.raises(ValueError, match="decode"):
        calibrate_cpu({k: v for k, v in bench.items() if k != "decode"})
    other = json.loads(json.dumps(bench))
    other["model"]["hidden"] = 2048
    with pytest.raises(ValueError, match="another model"):
        check_prediction(calibrate_cpu(bench), other)


def test_load_moves_the_cores_the_actors_get_not_their_cpu_cost_per_flop():
    """Three recorded runs of the same decode bench, one quiet, two while other test suites loaded the box
    (transformers' own step 4.3x and 11.6x slower): the experts' FLOP per CPU-second agrees within 25 %, while the
    fitted parallelism (cores' worth the actors got) falls with the load. So a fit on a quiet box predicts a loaded
    one only once the load is known (check_prediction's load factor)."""
    fits = [calibrate_cpu(_bench(n)).fitted for n in ("calibration.json", "validation_loaded.json",
                                                       "validation_loaded2.json")]
    rates = [f["expert_flops_per_cpu_s"] for f in fits]
    assert max(rates) / min(rates) < 1.25, rates
    assert fits[0]["cpu_parallelism"] > fits[1]["cpu_parallelism"] > fits[2]["cpu_parallelism"]
    check = check_prediction(calibrate_cpu(_bench("calibration.json")), _bench("validation_loaded.json"))
    assert not check["within_25"] and check["load_factor"] > 4  # raw: the load, not the model, dominates


TWO_BATCH = RESULTS / "two_batch"  # five quiet runs back to back: calibration at 32 and 8, validation at 32, 16, 8


def _run(name: str) -> dict:
    return json.loads((TWO_BATCH / name).read_text())


def test_two_batch_fit_predicts_separate_quiet_runs_within_25_percent():
    """One run cannot tell a fixed cost from a per-token one: fitted at 32 sequences it misses 16 and 8 by 35-65 %
    (an expert call streams its 35 MB of weights whatever its rows). Fitted at 32 and 8, it predicts three separate
    runs (32, 16, 8) within the ±25 % target (#26)."""
    one = calibrate_cpu(_run("calibration_b32.json"))
    two = calibrate_cpu(_run("calibration_b32.json"), second=_run("calibration_b8.json"))
    for name in ("validation_b32.json", "validation_b16.json", "validation_b8.json"):
        check = check_prediction(two, _run(name))
        assert check["within_25"], (name, check)
    for name in ("validation_b16.json", "validation_b8.json"):
        assert check_prediction(one, _run(name))["error"] < -0.25, name
    for name in ("calibration_b32.json", "calibration_b8.json"):  # and it reproduces its own two runs closely
        assert abs(check_prediction(two, _run(name))["error"]) < 0.05, name


def test_two_batch_fit_constants_are_physical():
    fit = calibrate_cpu(_run("calibration_b32.json"), second=_run("calibration_b8.json"))
    f = fit.fitted
    assert 1e9 < f["expert_read_bytes_per_s"] < 1e11  # a CPU's memory read rate per CPU-second
    assert 1e-6 < f["dense_op_overhead_s"] < 1e-3  # an eager op on the router's CPU
    assert 1e9 < f["dense_flops_per_s"] < 1e12 and 1e9 < f["expert_flops_per_cpu_s"] < 1e12
    assert f["sequences_per_run"] == [32, 8] and len(f["cpu_parallelism_per_run"]) == 2
    assert 0.05 < f["cpu_parallelism"] <= 2
    # the fixed costs make small batches dearer per token than one run's fit says
    step8 = StepShape(8, 8, 64)
    assert predict_step(fit.profile, step8).step_s > 2 * predict_step(calibrate_cpu(_run("calibration_b32.json"))
                                                                       .profile, step8).step_s


def test_two_batch_fit_refuses_runs_it_cannot_combine():
    a, b = _run("calibration_b32.json"), _run("calibration_b8.json")
    with pytest.raises(ValueError, match="different batch sizes"):
        calibrate_cpu(a, second=_run("validation_b32.json"))
    other = json.loads(json.dumps(b))
    other["transport"] = "grpc"
    with pytest.raises(ValueError, match="another model or transport"):
        calibrate_cpu(a, second=other)


def test_bench_dispatch_decode_sequences_flag():
    from expertmesh.ops.bench.dispatch import DispatchParams
    from expertmesh.ops.cli import build_parser

    args = build_parser().parse_args(["bench", "dispatch", "--workload", "decode", "--decode-sequences", "8"])
    assert DispatchParams.from_args(args).decode == {"sequences": 8, "context": 64}
    args = build_parser().parse_args(["bench", "dispatch", "--decode-sequences", "0"])
    with pytest.raises(ValueError, match="--decode-sequences"):
        DispatchParams.from_args(args)


# ---- the overlap choice --------------------------------------------------------------------------------------------


def test_overlap_pays_on_a_gpu_at_batch_64_and_up_not_at_batch_1():
    p = _gpu(transport="refs")  # a round of ~1.5 ms latency: half a batch's dense work hides under the other's
    assert not should_overlap(StepShape(1, 1, 4096), p)  # one sequence: nothing to split
    # At 32 the whole step replayed as CUDA graphs beats two eager halves (the decoder graphs unsplit steps only);
    # with graphs off, overlap pays there too.
    assert not should_overlap(StepShape(32, 32, 4096), p)
    eager = replace(p, hardware=replace(p.hardware, graph_launch_s=None))
    assert should_overlap(StepShape(32, 32, 4096), eager)
    for batch in (64, 256):
        step = StepShape(batch, batch, 4096)
        assert should_overlap(step, p), batch
        assert overlapped_layer_s(p, step) < moe_layer_time(p, step).total
        assert predict_step(p, step).overlap and predict_step(p, step).tokens_per_s > \
            predict_step(p, step, overlap=False).tokens_per_s


def test_overlap_never_pays_on_the_cpu():
    fit = calibrate_cpu(_bench("calibration.json"))
    for batch in (2, 32, 256):
        step = StepShape(batch, batch, 64)
        assert not should_overlap(step, fit.profile)
        # and the model agrees with the measurement that it would cost: both halves pay their fixed costs
        assert overlapped_layer_s(fit.profile, step) > moe_layer_time(fit.profile, step).total
    assert not should_overlap(StepShape(32, 32, 64), Profile(MIXTRAL, CPU_BASE, gpu_transports()["socket"],
                                                              Layout(1, 8)))


def test_overlap_does_not_pay_when_nothing_is_left_to_hide():
    # Two sequences without context: each half costs about the whole (weights read twice, fixed costs twice).
    assert not should_overlap(StepShape(2, 2, 1), _gpu(transport="socket"))
    # Mixtral at batch 32 over rdt: both halves hit all 8 experts, so the expert GPUs read every weight twice,
    # which costs more than the short round hides.
    p = _gpu(transport="rdt")
    step = StepShape(32, 32, 1024)
    assert not should_overlap(step, p)
    assert moe_layer_time(p, step.half()).expert == pytest.approx(moe_layer_time(p, step).expert, rel=0.01)


def test_step_policy_caches_and_follows_the_profile():
    cpu = StepOverlapPolicy(runtime_profile(_Cfg(), "cpu", "", "socket", 8))
    assert cpu([1] * 32, [4096] * 32) is False
    gpu = StepOverlapPolicy(runtime_profile(_Cfg(), "cuda", "NVIDIA H100 80GB HBM3", "socket", 7))
    assert gpu([1], [4096]) is False and gpu([1] * 128, [4096] * 128) is True
    assert len(gpu._seen) == 1  # one decision cached; a second call is a lookup
    assert gpu([1] * 128, [4000] * 128) is True and len(gpu._seen) == 1  # same power-of-two context bucket
    assert runtime_profile(_Cfg(), "cuda", "NVIDIA A10G", "socket", 7) is None  # no profile: the router turns it off
    assert StepOverlapPolicy(None)([1] * 64, [4096] * 64) is False


class _Cfg:
    """The attributes shape_from_config reads, Mixtral-8x7B's (a MoEModelConfig stand-in without torch)."""

    family, hidden_size, num_layers, moe_layers, num_experts, top_k = "mixtral", 4096, 32, tuple(range(32)), 8, 2
    expert_intermediate_size, num_heads, num_kv_heads, head_dim, vocab_size = 14336, 32, 8, 128, 32000
    dense_intermediate_size = shared_expert_intermediate_size = kv_lora_rank = 0
    qk_nope_head_dim = qk_rope_head_dim = v_head_dim = 0
    attention_kind, q_lora_rank = "gqa", None


def test_shape_from_config_equals_the_table_entry():
    assert replace(runtime_profile(_Cfg(), "cpu", "", "socket", 8).model, name=MIXTRAL.name) == MIXTRAL


# ---- GPU predictions -------------------------------------------------------------------------------------------


def test_layouts_pick_the_lightest_expert_format_that_fits():
    assert node_layout(MIXTRAL, GPUS["H100"], 8, 1, 1024)[0].expert_bytes == EXPERT_BYTES["bf16"]
    # DeepSeek-V3's 656 B routed parameters: 1.3 TB in bf16 fit neither node; int8 fits 7 x 141 GB, int4 7 x 80 GB.
    assert node_layout(DEEPSEEK, GPUS["H200"], 8, 1, 1024)[0].expert_bytes == EXPERT_BYTES["int8"]
    assert node_layout(DEEPSEEK, GPUS["H100"], 8, 1, 1024)[0].expert_bytes == EXPERT_BYTES["int4"]
    layout, why = node_layout(QWEN, GPUS["H200"], 1, 1, 1024)
    assert layout.shared_device and "one GPU" in why
    assert node_layout(DEEPSEEK, GPUS["H100"], 2, 1, 1024)[0] is None


def test_transport_ordering_and_hbm_bandwidth_show_in_the_prediction():
    step = StepShape(1, 1, 1024)
    tps = {t: predict_step(_gpu(transport=t), step).tokens_per_s for t in TRANSPORTS}
    assert tps["refs"] < tps["grpc"] < tps["compiled"]  # a classic Ray call costs ~1 ms per layer
    # rdt as built: a classic Ray call plus Ray's RDT work on both sides (measured here): the slowest at batch 1.
    assert tps["rdt"] < tps["refs"]
    # Its bytes still go device to device: without any call's fixed cost, at batch 256 (where the rows' bytes
    # matter) rdt's round is the shorter one.
    big = StepShape(256, 256, 1024)
    bytes_only = {t: moe_layer_time(replace(_gpu(transport=t), transport=replace(
        gpu_transports()[t], call_s=0.0, issue_s=0.0)), big).transport for t in ("rdt", "socket")}
    assert bytes_only["rdt"] < bytes_only["socket"]
    assert predict_step(_gpu(gpu="H200"), step).tokens_per_s > predict_step(_gpu(gpu="H100"), step).tokens_per_s


def test_prediction_table_and_targets_cover_the_three_models():
    rows = prediction_rows(batches=(1, 32))
    assert {r["key"] for r in rows} == set(MODELS) and len(rows) == 3 * 2 * 2
    for r in rows:
        assert set(r["tokens_per_s"]) == set(TRANSPORTS)
        assert all(v > 0 for v in r["tokens_per_s"].values())
    names = [t["target"] for t in targets()]
    assert any("150 us" in n for n in names) and any("one H200" in n for n in names)


def test_gpu_names_and_table_aliases():
    assert gpu_profile("NVIDIA H200") is GPUS["H200"] and gpu_profile("NVIDIA H100 80GB HBM3") is GPUS["H100"]
    assert known_model("mistralai/Mixtral-8x7B-Instruct-v0.1") is MIXTRAL and known_model("/some/folder") is None


# ---- plan-cluster --latency and purity --------------------------------------------------------------------------


def test_plan_cluster_latency_json_for_a_table_model_needs_no_checkpoint(capsys):
    from expertmesh.ops.cli import main

    assert main(["plan-cluster", "--model", "qwen3-30b-a3b", "--latency", "--gpu-type", "H200", "--gpus-per-node",
                 "8", "--batch", "1", "--batch", "32", "--transport", "rdt", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    entry = out["latency"][0]
    assert entry["gpu_type"] == "H200" and [b["batch"] for b in entry["batches"]] == [1, 32]
    layer = entry["batches"][0]["transports"]["rdt"]["layer_us"]
    assert set(layer) == {"router_dense", "plan", "transport", "expert", "combine"}
    assert main(["plan-cluster", "--model", "mixtral-8x7b", "--latency", "--batch", "1"]) == 0
    text = capsys.readouterr().out
    assert "8 x H100" in text and "8 x H200" in text and "tok/s" in text


def test_cost_modules_import_no_torch_or_ray():
    code = ("import sys, expertmesh.cluster.cost_report, expertmesh.cluster.cost_calibration, "
            "expertmesh.cluster.overlap_policy; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'ray', 'grpc'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_the_docs_page_shows_the_models_current_tables():
    from expertmesh.cluster.cost_report import markdown_layers, markdown_table, markdown_targets, markdown_what_if

    page = (Path(__file__).resolve().parents[2] / "docs" / "concepts" / "cost-model.md").read_text()
    for block in (markdown_table(), markdown_layers(), markdown_targets(), markdown_what_if()):
        assert block in page, "docs/concepts/cost-model.md is stale: paste cluster/cost_report.py's tables"


def test_plan_cluster_latency_on_a_checkpoint_adds_the_prediction_to_the_fit(checkpoints, capsys):
    from expertmesh.ops.cli import main

    assert main(["plan-cluster", "--model", str(checkpoints["mixtral"]), "--gpu-type", "H100", "--gpus-per-node", "8",
                 "--latency", "--batch", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"][0]["gpu_type"] == "H100"  # the memory fit is still there
    row = out["latency"][0]["batches"][0]
    assert row["batch"] == 4 and set(row["transports"]) == set(TRANSPORTS)
    assert all(t["tokens_per_s"] > 0 for t in row["transports"].values())
