"""`expertmesh drill` end to end, as an operator runs it: the CLI as a subprocess starts its own Ray and server,
kills expert actors under load, and writes its report. With two replicas per expert and the wait policy, the
controller restores every killed actor and no request fails or changes its greedy output. The record it saves
rebuilds the same report through the pure scorer (ops/drill/report.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from expertmesh.ops.drill import DrillRecord, build_report

# A drill-length module (minutes of Ray, servers and kills): in CI's default set again (CI's limit is 90 minutes;
# the whole run stays well under 45).

RESTORE_BOUND_S = 45
DRILL_TIMEOUT_S = 600  # the drill itself takes ~1 min on 2 cores; most of it is starting 8 expert actors


def test_actor_kill_drill_loses_no_request_and_restores_every_replica(tmp_path, checkpoints):
    out = tmp_path / "drill"
    # The tiny 4-expert Mixtral (no tokenizer: the drill sends token ids) rather than the embedded 8-expert model:
    # 8 actors to start instead of 16, the same drill.
    proc = subprocess.run(
        [sys.executable, "-m", "expertmesh.ops.cli", "drill", "--model", str(checkpoints["mixtral"]),
         "--kill", "actor", "--duration", "12", "--every", "6",
         "--baseline", "6", "--replicas-per-expert", "2",
         "--expert-layout", "per-expert", "--concurrency", "4", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=DRILL_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report == json.loads((out / "drill_report.json").read_text())
    rebuilt = build_report(DrillRecord.load(out / "drill_record.json"))
    assert json.loads(json.dumps(rebuilt)) == {k: v for k, v in report.items() if k != "files"}

    requests = report["requests"]
    assert requests["sent"] > 0 and requests["by_phase"]["faults"]["sent"] > 0, requests
    assert requests["failed"] == 0, requests["failed_by_code"]
    outputs = report["outputs"]
    assert outputs["prompts_with_reference"] == outputs["prompts"], outputs
    assert outputs["compared"] > 0 and outputs["mismatches"] == 0 and outputs["unverified"] == 0, outputs
    assert report["tokens"]["degraded"] == 0

    kills = report["kills"]
    assert len(kills) == 2, kills  # at 0 s and 6 s of the 12 s fault phase
    for kill in kills:
        assert kill["error"] is None and len(kill["targets"]) == 1, kill
        assert kill["detect_s"] is not None and kill["detect_s"] >= 0, kill
        # A restore is a new Ray worker process importing torch and loading its weights: ~5 s on a quiet 2-core
        # machine, 22 s seen on CI's busy one with 16 actors and the load beside it. The bound catches a restore
        # that waits on something (a probe period, a retry loop), not the machine's speed.
        assert kill["restore_s"] is not None and kill["restore_s"] <= RESTORE_BOUND_S, kill
    assert report["targets"]["zero_failed_requests"]["met"]
    assert report["targets"]["identical_greedy_outputs"]["met"]
    # Scored against the restores above (met on a quiet machine; the bound above is what CI's speed allows).
    assert report["targets"]["restored_within_15s"]["met"] == all(k["restore_s"] <= 15 for k in kills)
    assert report["cluster"]["replicas_expected"] == 8  # 4 experts x 2 replicas
    assert report["server"]["exit_code"] == 0

    png = out / "drill_timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "drill_report.md").read_text()
    assert "# expertmesh drill: kill actor" in markdown and "## Targets" in markdown
