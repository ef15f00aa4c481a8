"""How long detection and restores take, for the fleet simulator: a model built from this project's own drill
reports (docs/benchmarks/results/drills/*/drill_report.json, written by `expertmesh drill`) and from the mechanisms
that set the times. Pure; no Ray.

What sets each time (the drills of docs/operations/drills.md measured them on a 2-node cluster of a 2-core machine):
- A dead actor process is seen at the controller's next probe pass: uniform over `check_interval_s` (0.5 s,
  cluster/controller_config.py), i.e. half of it on average (the actor drill measured 0.04-0.43 s).
- A lost node whose expert actors the controller can still probe is seen when the probes fail
  (`node_detect_s`: the "node" drill's detect time).
- A lost node that also hosted the controller is seen only after Ray declares the node dead and restarts the
  controller elsewhere: Ray's GCS health check (src/ray/common/ray_config_def.h: health_check_period_ms 3000 x
  health_check_failure_threshold 5 = 15 s), then the controller's restart (the controller drill's `recreated_s`),
  then one probe pass.
- Restoring an actor at its normal share: the actor drill's `controller_restore_work_s` (spawn, import, load,
  warm-up of a tiny model) plus, at DeepSeek-V3 scale, reading its shards' weights (`shard_bytes / load_gb_s` each).
- A stand-in on the survivors (cluster/lost_restore.py): the node-no-spare drill's stand-in start.
- A live remap (the planner's new placement published, new replicas loaded and warmed): the rebalance drill's
  remap `ready_s`, plus the weights of the shards the busiest GPU must load.

`from_reports` reads those figures from the committed reports (medians; `actor_kills` picks which of the actor
drill's kills calibrate, so a test can hold the others out). `restore_seconds` composes them for one fault, which is
what the simulator schedules and what tests/unit/test_fleet_sim.py checks against the drills' end-to-end restore
times.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

RAY_HEALTH_CHECK_PERIOD_S = 3.0  # ray_config_def.h: health_check_period_ms = 3000
RAY_HEALTH_CHECK_FAILURES = 5  # ray_config_def.h: health_check_failure_threshold = 5
DRILLS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "results" / "drills"


@dataclass(frozen=True)
class RestoreTimes:
    check_interval_s: float = 0.5  # the controller's probe period (ControllerConfig.check_interval_s)
    node_detect_s: float = 2.8  # a lost node's actors seen lost by a live controller
    node_dead_s: float = RAY_HEALTH_CHECK_PERIOD_S * RAY_HEALTH_CHECK_FAILURES  # Ray marks a silent node dead
    controller_restart_s: float = 1.3  # Ray re-creates the detached controller on a live node
    actor_start_s: float = 4.0  # restore of one actor at its normal share, weights aside
    stand_in_start_s: float = 2.2  # a stand-in on the survivors started and published
    remap_s: float = 6.8  # a live remap: planned, published, new replicas ready
    load_gb_s: float = 2.0  # weight read rate into one GPU (assumed: local NVMe / page cache)
    source: str = "defaults"

    def detect_seconds(self, node_lost: bool, controller_lost: bool, phase: float = 0.5) -> float:
        """From the fault to the controller's "lost" event. phase in [0, 1): where in the probe period the fault
        fell (0.5: the mean)."""
        probe = phase * self.check_interval_s
        if controller_lost:
            return self.node_dead_s + self.controller_restart_s + probe
        if node_lost:
            return self.node_detect_s
        return probe

    def load_seconds(self, shard_bytes: float, shards: int) -> float:
        return shard_bytes * shards / (self.load_gb_s * 1e9)

    def restore_seconds(self, how: str, node_lost: bool = False, controller_lost: bool = False,
                        shard_bytes: float = 0.0, shards: int = 0, phase: float = 0.5) -> float:
        """From the fault until the lost shards serve again. how: "full" (an actor at its normal share: in place or
        on a spare), "stand_in" (cluster/lost_restore.py's stand-in on the survivors) or "remap" (the planner's new
        placement); shards: what the busiest receiving GPU loads, shard_bytes each."""
        detect = self.detect_seconds(node_lost, controller_lost, phase)
        load = self.load_seconds(shard_bytes, shards)
        work = {"full": self.actor_start_s, "stand_in": self.stand_in_start_s, "remap": self.remap_s}
        if how not in work:
            raise ValueError(f"how: must be one of {sorted(work)}, got {how!r}")
        return detect + work[how] + load


def load_report(name: str, drills: Path = DRILLS) -> dict:
    """One committed drill report (drills/<name>/drill_report.json)."""
    path = Path(drills) / name / "drill_report.json"
    with path.open() as f:
        return json.load(f)


def actor_restores(report: dict) -> list[dict]:
    """Per killed actor of a report: {detect_s, restore_s, work_s}, restored ones only, in kill order."""
    out = []
    for kill in report.get("kills", []):
        for actor in (kill.get("actors") or {}).values():
            if actor.get("restore_s") is not None and actor.get("controller_restore_work_s") is not None:
                out.append({"detect_s": actor["detect_s"], "restore_s": actor["restore_s"],
                            "work_s": actor["controller_restore_work_s"]})
    return out


def from_reports(drills: Path = DRILLS, actor_kills: slice = slice(None)) -> RestoreTimes:
    """RestoreTimes with every measured figure read from the committed drill reports (medians):
    actor -> actor_start_s (restore work of the kills in `actor_kills`); node -> node_detect_s (a live controller);
    node-no-spare -> stand_in_start_s; controller -> controller_restart_s (recreated_s); rebalance -> remap_s."""
    actor = actor_restores(load_report("actor", drills))[actor_kills]
    assert actor, "actor drill: no restored kill to calibrate from"
    node = load_report("node", drills)
    node_detect = [k["detect_s"] for k in node["kills"] if k.get("detect_s") is not None]
    no_spare = actor_restores(load_report("node-no-spare", drills))
    controller = [k["recreated_s"] for k in load_report("controller", drills)["kills"] if k.get("recreated_s")]
    events = load_report("rebalance", drills).get("cluster", {}).get("events", [])
    remaps = [e["ready_s"] for e in events if e.get("kind") == "remap" and e.get("ready_s") is not None]
    base = RestoreTimes()
    return RestoreTimes(
        check_interval_s=base.check_interval_s,
        node_detect_s=statistics.median(node_detect) if node_detect else base.node_detect_s,
        controller_restart_s=statistics.median(controller) if controller else base.controller_restart_s,
        actor_start_s=statistics.median(a["work_s"] for a in actor),
        stand_in_start_s=statistics.median(a["work_s"] for a in no_spare) if no_spare else base.stand_in_start_s,
        remap_s=statistics.median(remaps) if remaps else base.remap_s,
        load_gb_s=base.load_gb_s,
        source=_relative(drills),
    )


def _relative(path: Path) -> str:
    """path relative to the repository when it is inside it (results stay the same on every checkout)."""
    try:
        return str(Path(path).resolve().relative_to(DRILLS.parents[3]))
    except ValueError:
        return str(path)
