"""`expertmesh plan` round trip through a subprocess, and `bench placement --quick` on its own (no Ray)."""

import json
import subprocess
import sys

import numpy as np

from expertmesh.cluster.shard_placement import Placement, moves
from expertmesh.ops.bench.placement import PlacementParams, run_placement_bench


def expertmesh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_plan_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    load = [rng.permutation(1000 / np.arange(1, 17) ** 1.1).tolist() for _ in range(3)]
    (tmp_path / "load.json").write_text(json.dumps({"load": load}))
    (tmp_path / "plain.json").write_text(json.dumps(load))
    out = tmp_path / "p.json"
    run = expertmesh("plan", "--load", str(tmp_path / "load.json"), "--gpus", "4", "--slots-per-gpu", "6",
                     "--nodes", "2", "--out", str(out), "--json")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    placement = Placement.loads(out.read_text())
    assert placement.layers == 3 and placement.experts == 16 and placement.topology.gpus_per_node == 2
    assert summary["replicas"] == placement.total_replicas() == 3 * 24
    assert max(summary["max_over_mean_after"]) < min(summary["max_over_mean_before"])
    # The same load against that placement: nothing to move. A failed GPU: its shards move, it hosts nothing.
    again = expertmesh("plan", "--load", str(tmp_path / "plain.json"), "--gpus", "4", "--slots-per-gpu", "6",
                       "--nodes", "2", "--current", str(out), "--json", "--out", str(tmp_path / "same.json"))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["moves"] == 0
    failed = expertmesh("plan", "--load", str(tmp_path / "load.json"), "--gpus", "4", "--slots-per-gpu", "6",
                        "--nodes", "2", "--current", str(out), "--failed-gpus", "1")
    assert failed.returncode == 0, failed.stderr
    moved = Placement.loads(failed.stdout)  # no --out: the placement on stdout, the summary on stderr
    assert (moved.slots[:, 1] == -1).all() and "moves from current" in failed.stderr
    assert moves(placement, moved) > 0


def test_plan_bad_input_names_the_field(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"load": [1, 2, 3]}))
    run = expertmesh("plan", "--load", str(tmp_path / "bad.json"), "--gpus", "2", "--slots-per-gpu", "2")
    assert run.returncode == 2 and "--load" in run.stderr and "Traceback" not in run.stderr
    (tmp_path / "ok.json").write_text(json.dumps([[1, 2, 3]]))
    run = expertmesh("plan", "--load", str(tmp_path / "ok.json"), "--gpus", "3", "--slots-per-gpu", "1",
                     "--nodes", "2")
    assert run.returncode == 2 and "--gpus" in run.stderr


def test_bench_placement_quick():
    result = run_placement_bench(PlacementParams(seed=1, repeats=1, quick=True))
    names = [t["trace"] for t in result["traces"]]
    assert names[:4] == ["zipf-0.8", "zipf-1.0", "zipf-1.2", "random"]
    assert result["summary"]["never_worse_than_greedy"]
    for trace in result["traces"]:
        assert trace["extra_replicas_pct"] <= 25.0
        for row in trace["drift"]:
            assert row["slack_0.0"]["peak_vs_greedy_worst"] <= 1 + 1e-9
            assert row["slack_0.0"]["moves"] <= row["from_scratch_moves"]
