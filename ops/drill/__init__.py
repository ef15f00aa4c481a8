"""`expertmesh drill`: a failover drill under load, with a report.

The drill (by default) starts its own Ray -- one local node, or for `--kill node` a `ray.cluster_utils.Cluster`
with a head and `--nodes` workers -- and runs `expertmesh serve --address <that cluster>` as a subprocess. Being a
driver on the same cluster, it can kill actors directly. With `--target HOST:PORT --address ADDR` it attaches to a
server and cluster that are already running instead (without `--address` only expert actors can be killed, through
Admin.KillReplica).

Kills: `actor` one random live expert actor per tick; `fraction` a random share of them per tick; `node` one worker
node, once (only on a cluster the drill started); `router` one Serve replica of the router deployment; `controller`
the controller actor (the serve process recreates it); `chaos` all at once (chaos.py: a node, the controller and a
share of the actors at the first tick, a share of the actors every tick, the controller every second tick); `none`
nothing -- a soak, whose report says whether resident memory, descriptors and KV blocks stayed flat (resources.py
samples them for every drill the drill started itself). Per kill the report gives the time to detection (the
controller's `lost` event) and to restore (its `restored` event), or for router / controller kills the time until
requests succeed / GetClusterState reports the controller again.

Three parts, one idea each:
  config.py  DrillConfig (every setting, validated) and serve_args (the self-started server's arguments)
  run.py     running it -- Ray, server, load, kills, polls -- into a DrillRecord (record.py), nothing else
  chaos.py   PURE: what one chaos tick kills
  resources.py  /proc samples of what the drill started, and PURE flatness scoring
  report.py  PURE scoring: the report dict from a DrillRecord (no Ray, gRPC or OpenTelemetry)
  render.py  the timeline PNG, drill_report.md and the terminal summary, from the report

Outputs in `config.out`: drill_record.json (what happened; `build_report(DrillRecord.load(path))` rebuilds the
report), drill_report.json, drill_report.md, drill_timeline.png (and serve.log for a self-started server).
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import DrillConfig, serve_args
from .record import DrillRecord
from .render import markdown, plot_resources, plot_timeline, summary
from .report import build_report

__all__ = ["DrillConfig", "DrillRecord", "build_report", "run_drill", "serve_args", "write_report"]


def write_report(record: DrillRecord, out: str | Path) -> dict:
    """Score `record` and write drill_record.json, drill_report.json / .md and drill_timeline.png into `out`;
    returns the report with its `files` and a `summary` (the summary is not written to the JSON)."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = build_report(record)
    report["files"] = {"json": str(out_dir / "drill_report.json"), "markdown": str(out_dir / "drill_report.md"),
                       "png": str(out_dir / "drill_timeline.png"), "record": str(out_dir / "drill_record.json")}
    record.save(out_dir / "drill_record.json")
    plot_timeline(report, out_dir / "drill_timeline.png")
    if plot_resources(report, out_dir / "drill_resources.png"):
        report["files"]["resources_png"] = str(out_dir / "drill_resources.png")
    (out_dir / "drill_report.md").write_text(markdown(report))
    (out_dir / "drill_report.json").write_text(json.dumps(report, indent=2) + "\n")
    report["summary"] = summary(report)
    return report


def run_drill(config: DrillConfig, verbose: bool = True) -> dict:
    """Run a failover drill and write its record and report into `config.out`; returns the report (with a
    `summary`). Everything it started (server subprocess, Ray or Cluster) is stopped on return, error or Ctrl-C.
    ValueError("field: ...") for an invalid config, before anything starts."""
    config.validate()
    from .run import record_drill  # Ray and gRPC only here: scoring and rendering a saved record need neither

    return write_report(record_drill(config, verbose), config.out)
