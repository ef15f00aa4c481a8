"""`bench dispatch` and `bench serve` report assembly on crafted timings and rates (ops/bench/dispatch_report.py,
serve_report.py): the figures a benchmark JSON carries, without a mesh, a server or Ray."""

from __future__ import annotations

from expertmesh.ops.bench.dispatch_report import forward_summary, with_noop_floor
from expertmesh.ops.bench.serve_report import add_eta, engine_levels


def test_dispatch_summary_takes_medians_and_splits_rounds_from_dense_work():
    # 8 tokens; transformers 0.1 s per forward, ours 0.2 s of which 0.12 s in the 4 layers' expert rounds; the actors
    # spent 0.16 CPU-s computing, spread over 2 cores: 0.08 s of the rounds' wall time is their work.
    got = forward_summary(8, hf_times=[0.1, 0.3, 0.1], mesh_times=[0.2, 0.2, 0.9], rounds=[0.12, 0.5, 0.12],
                          delta=0.0, compute=[0.16, 0.16, 0.2], layers=4, cores=2)
    assert got["transformers_tokens_per_s"] == 80.0 and got["expertmesh_tokens_per_s"] == 40.0
    assert got["eta"] == 0.5
    assert got["expertmesh_dense_s"] == 0.08 and got["expertmesh_expert_rounds_s"] == 0.12
    assert got["per_layer_round_ms"] == 30.0 and got["per_layer_overhead_ms"] == 10.0
    assert with_noop_floor(got, noop_round_ms=2.5)["overhead_vs_noop_floor"] == 4.0


def test_dispatch_overhead_is_never_negative():
    got = forward_summary(1, [1.0], [1.0], rounds=[0.1], delta=0.0, compute=[0.4], layers=2, cores=1)
    assert got["per_layer_overhead_ms"] == 0.0  # the experts' compute covers the whole round


def _rate(tokens: int, wall: float) -> dict:
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": round(tokens / wall, 3), "batch": 1, "rounds": 1,
            "torch_threads": 2}


def test_serve_eta_combines_the_reference_before_and_after_each_level():
    run = {"levels": {"1": {"aggregate_tokens_per_s": 30.0}, "8": {"aggregate_tokens_per_s": 150.0}},
           "eta_serve": {}}
    before = {"1": _rate(50, 1.0), "8": _rate(300, 1.0)}
    after = {"1": _rate(50, 1.5), "8": _rate(300, 3.0)}  # the machine got slower: both runs count
    engine = {"1": {"tokens_per_s": 60.0}, "8": {"tokens_per_s": 200.0}}
    add_eta(run, before, after, engine)
    assert run["levels"]["1"]["transformers"]["tokens_per_s"] == 40.0
    assert run["eta_serve"] == {"1": 0.75, "8": 1.0}
    assert run["levels"]["8"]["served_vs_engine"] == 0.75
    assert engine_levels(engine, {"1": {"tokens_per_s": 40.0}, "8": {"tokens_per_s": 0.0}}) == {
        "1": {"tokens_per_s": 60.0, "vs_transformers": 1.5}, "8": {"tokens_per_s": 200.0, "vs_transformers": None}}
