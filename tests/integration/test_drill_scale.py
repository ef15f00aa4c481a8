"""Chaos at scale and the soak, end to end through the `expertmesh drill` CLI (a subprocess that starts its own
`ray.cluster_utils.Cluster` and server).

- In CI: chaos on a head + 3 workers with the tiny 4-expert Mixtral, two replicas of each expert (8 actors): at the
  first tick a worker node, the controller and a share of the actors go together, then actors every tick and the
  controller every second one. No request may fail and no greedy output may change; every kill recovers (the node's
  included). The CLI's report, record and files are checked as an operator reads them.
- Slow-marked (reports committed under docs/benchmarks/results/drills/): the same on 8 workers with a 32-expert model
  (64 actors), and a 30-minute soak whose resident memory and descriptors must stay flat within +-5 %.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from expertmesh.ops.drill import DrillRecord, build_report

CLI = [sys.executable, "-m", "expertmesh.ops.cli", "drill"]


def _drill(args: list[str], out: Path, timeout_s: float) -> dict:
    proc = subprocess.run(CLI + args + ["--out", str(out), "--json"], capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _assert_no_request_lost(report: dict) -> None:
    requests = report["requests"]
    assert requests["sent"] > 0 and requests["by_phase"]["faults"]["sent"] > 0, requests
    assert requests["failed"] == 0, requests["failed_by_code"]
    outputs = report["outputs"]
    assert outputs["compared"] > 0 and outputs["mismatches"] == 0 and outputs["unverified"] == 0, outputs
    assert report["server"]["exit_code"] == 0


def _assert_chaos_recovered(report: dict, expected_actors: int) -> None:
    kills = report["kills"]
    modes = [k["mode"] for k in kills]
    assert {"node", "controller", "fraction"} <= set(modes), modes
    first = [k for k in kills if k["index"] == 0]
    assert {k["mode"] for k in first} == {"node", "controller", "fraction"}, first  # together, at one tick
    node_targets = {a for k in first if k["mode"] == "node" for a in k["targets"]}
    actor_targets = {a for k in first if k["mode"] == "fraction" for a in k["targets"]}
    assert node_targets and not node_targets & actor_targets  # a node's actors are not killed twice
    for kill in kills:
        assert kill["error"] is None, kill
        assert kill["mode"] == "controller" or kill.get("detect_s") is not None, kill
        # Every kill recovers: restored, or stood in for / deferred to the shards' other replicas. A restore planned
        # into a share another plan's actor took waits in Ray's queue; the controller kills it after
        # restore_unplaced_s and plans it again (stop 36's CI run: a fraction kill queued for good without that).
        assert kill["recovered_at_s"] is not None, kill
    assert report["cluster"]["replicas_expected"] == expected_actors
    samples = report["resources"]["series"]
    assert len(samples["t_s"]) >= 3 and max(samples["procs"]["expert_actors"]) >= expected_actors // 2, samples


def test_chaos_on_four_nodes_loses_no_request(tmp_path, checkpoints):
    # The tiny 4-expert Mixtral, two replicas each: 8 actors on 4 nodes (the slow 8-node drill runs 64).
    report = _drill(["--kill", "chaos", "--model", str(checkpoints["mixtral"]), "--nodes", "3", "--node-cpus", "2",
                     "--expert-layout", "per-expert",
                     "--replicas-per-expert", "2", "--every", "6", "--duration", "12", "--baseline", "6",
                     "--concurrency", "4", "--fraction", "0.1", "--sample-every", "1", "--settle", "60"],
                    tmp_path / "chaos",
                    timeout_s=900)
    _assert_no_request_lost(report)
    _assert_chaos_recovered(report, expected_actors=8)
    out = tmp_path / "chaos"
    assert (out / "drill_resources.png").read_bytes()[:4] == b"\x89PNG"
    # What the drill writes, as an operator reads it (this test also stands for the one-mode actor-kill drill that
    # test_drill.py ran before CI went over its 45-minute bound: the same CLI, kills and report, 84 s more): the
    # JSON it printed is the file, the saved record rebuilds the same report through the pure scorer, every prompt
    # had a reference, and the timeline and Markdown report exist.
    assert report == json.loads((out / "drill_report.json").read_text())
    rebuilt = build_report(DrillRecord.load(out / "drill_record.json"))
    assert json.loads(json.dumps(rebuilt)) == {k: v for k, v in report.items() if k != "files"}
    assert report["outputs"]["prompts_with_reference"] == report["outputs"]["prompts"], report["outputs"]
    assert report["targets"]["zero_failed_requests"]["met"] and report["targets"]["identical_greedy_outputs"]["met"]
    assert (out / "drill_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "# expertmesh drill: kill chaos" in (out / "drill_report.md").read_text()


def _many_expert_model(out: Path) -> Path:
    from tests.tiny_checkpoints import write_hf_checkpoint

    return write_hf_checkpoint("mixtral", out, num_local_experts=32, num_experts_per_tok=2)


@pytest.mark.slow
def test_chaos_on_eight_nodes_with_64_actors_loses_no_request(tmp_path):
    model = _many_expert_model(tmp_path / "model")
    out = Path(os.environ.get("EXPERTMESH_CHAOS_OUT", tmp_path / "chaos8"))
    report = _drill(["--kill", "chaos", "--nodes", "8", "--node-cpus", "6", "--cpus-per-actor", "0.5",
                     "--model", str(model), "--expert-layout", "per-expert", "--replicas-per-expert", "2",
                     "--every", "15", "--duration", "45", "--baseline", "20", "--concurrency", "4",
                     "--max-tokens", "8", "--fraction", "0.1", "--sample-every", "2", "--wait-timeout", "600",
                     "--ready-timeout", "2400", "--settle", "900"],
                    out, timeout_s=3600)
    _assert_no_request_lost(report)
    _assert_chaos_recovered(report, expected_actors=64)


@pytest.mark.slow
def test_a_30_minute_soak_stays_flat(tmp_path):
    out = Path(os.environ.get("EXPERTMESH_SOAK_OUT", tmp_path / "soak"))
    report = _drill(["--kill", "none", "--duration", "1800", "--every", "1800", "--baseline", "30",
                     "--concurrency", "4", "--sample-every", "10"], out, timeout_s=2700)
    _assert_no_request_lost(report)
    targets = report["targets"]
    for name in ("resident_memory_flat_within_5pct", "descriptors_flat_within_5pct", "kv_blocks_all_free_at_end"):
        assert targets[name]["applicable"] and targets[name]["met"], (name, targets[name],
                                                                     report["resources"]["flatness"])
