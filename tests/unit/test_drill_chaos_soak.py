"""Chaos ticks, resource sampling and soak scoring of `expertmesh drill` -- pure parts, no Ray.

The record used for scoring is a real short drill's (tests/unit/fixtures/drill_actor_wait.json) turned into a soak:
its kills removed, resource samples and KV-block polls written in, so the targets are checked on crafted numbers
whose answer is known."""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import pytest

from expertmesh.ops.commands.drill import KILL_CHOICES
from expertmesh.ops.drill import DrillConfig, DrillRecord, build_report
from expertmesh.ops.drill.chaos import plan_chaos_tick
from expertmesh.ops.drill.config import KILL_MODES
from expertmesh.ops.drill.render import markdown, plot_resources
from expertmesh.ops.drill.resources import ROLES, flatness, sample_tree

FIXTURE = Path(__file__).parent / "fixtures" / "drill_actor_wait.json"

ACTORS = {f"expert-e{i}-r{r}": f"node{i % 4}" for i in range(8) for r in range(2)}  # 16 actors on 4 nodes
WORKERS = ["node1", "node2", "node3"]  # node0 is the head


def test_cli_kill_choices_are_the_configs_kill_modes():
    assert tuple(KILL_CHOICES) == tuple(KILL_MODES)


def test_first_chaos_tick_removes_a_worker_the_controller_and_actors_elsewhere():
    plan = plan_chaos_tick(0, ACTORS, WORKERS, set(), fraction=0.25, rng=random.Random(3))
    assert plan.node in WORKERS and plan.controller
    assert len(plan.actors) == 4  # a quarter of the 16 live actors
    # the node's own actors die with it: never named again as actor kills
    assert all(ACTORS[a] != plan.node for a in plan.actors)
    assert plan.actors == sorted(set(plan.actors))


def test_later_ticks_kill_actors_every_tick_and_the_controller_every_second():
    rng = random.Random(0)
    plans = [plan_chaos_tick(i, ACTORS, WORKERS, {"node1"}, fraction=0.1, rng=rng) for i in range(1, 5)]
    assert [p.node for p in plans] == [None] * 4
    assert [p.controller for p in plans] == [False, True, False, True]
    assert all(len(p.actors) == 2 for p in plans)  # round(0.1 * 16) = 2, and at least one


def test_chaos_tick_never_removes_the_head_or_an_empty_node_and_survives_no_actors():
    only_head = {a: "node0" for a in ACTORS}
    plan = plan_chaos_tick(0, only_head, WORKERS, set(), fraction=0.5, rng=random.Random(1))
    assert plan.node is None and len(plan.actors) == 8
    assert plan_chaos_tick(0, {}, WORKERS, set(), fraction=0.5, rng=random.Random(1)).actors == []
    gone = plan_chaos_tick(0, ACTORS, WORKERS, set(WORKERS), fraction=0.5, rng=random.Random(1))
    assert gone.node is None


def test_chaos_plan_is_reproducible_from_the_seed():
    one = [plan_chaos_tick(i, ACTORS, WORKERS, set(), 0.2, random.Random(7)) for i in range(3)]
    two = [plan_chaos_tick(i, ACTORS, WORKERS, set(), 0.2, random.Random(7)) for i in range(3)]
    assert one == two


SHARDS = [[f"expert-e{i}-r0", f"expert-e{i}-r1"] for i in range(8)]  # one shard per expert, two replicas
SPREAD = {f"expert-e{i}-r{r}": f"node{(i + r) % 4}" for i in range(8) for r in range(2)}  # replicas apart


def test_chaos_budget_never_takes_every_live_replica_of_a_shard():
    for seed in range(50):
        plan = plan_chaos_tick(0, SPREAD, WORKERS, set(), fraction=0.5, rng=random.Random(seed), shards=SHARDS)
        gone = set(plan.actors) | {a for a, n in SPREAD.items() if n == plan.node}
        assert plan.node is not None
        assert all(set(shard) - gone for shard in SHARDS), (seed, plan)
        # Eight actors were asked for; each shard can give one, and the node already took some shards' one.
        assert len(gone) == 8, (seed, plan)


def test_chaos_budget_counts_replicas_already_dead_and_skips_the_node_when_it_would_empty_a_shard():
    live = {a: n for a, n in SPREAD.items() if not a.endswith("-r1")}  # every shard down to one live replica
    plan = plan_chaos_tick(0, live, WORKERS, set(), fraction=0.5, rng=random.Random(0), shards=SHARDS)
    assert plan.node is None and plan.actors == [] and plan.controller
    # Without the budget the same tick takes the node and half the actors.
    free = plan_chaos_tick(0, live, WORKERS, set(), fraction=0.5, rng=random.Random(0))
    assert free.node is not None and free.actors
    # Replicas of one expert on one node: that node can never go under the budget.
    together = plan_chaos_tick(0, ACTORS, WORKERS, set(), fraction=0.5, rng=random.Random(0), shards=SHARDS)
    assert together.node is None and len(together.actors) == 8


def _samples(values_rss: list[float], values_fds: list[int] | None = None, step: float = 10.0) -> list[dict]:
    fds = values_fds or [100] * len(values_rss)
    out = []
    for i, (rss, fd) in enumerate(zip(values_rss, fds)):
        roles = {role: {"procs": 0, "rss_bytes": 0, "fds": 0} for role in ROLES}
        roles["expert_actors"] = {"procs": 4, "rss_bytes": int(rss), "fds": fd}
        roles["ray_gcs"] = {"procs": 1, "rss_bytes": 100 * 2**20, "fds": 50}
        out.append({"t": 1000.0 + i * step, "roles": roles})
    return out


def test_flatness_ignores_the_warm_up_and_catches_a_slow_leak():
    warm_then_flat = [100e6] * 4 + [400e6] * 16  # grows during the first fifth only: warm-up
    report = flatness(_samples(warm_then_flat), limit=0.05)
    assert report["enough_samples"] and report["metrics"]["rss_bytes.total"]["flat"]
    assert report["metrics"]["rss_bytes.expert_actors"]["drift"] == 0
    leak = [400e6 * (1 + 0.01 * i) for i in range(20)]  # +1 % a sample: ~+15 % over the window
    row = flatness(_samples(leak), limit=0.05)["metrics"]["rss_bytes.expert_actors"]
    assert not row["flat"] and 0.10 < row["drift"] < 0.20, row
    fd_leak = flatness(_samples([400e6] * 20, [100 + 3 * i for i in range(20)]))["metrics"]["fds.expert_actors"]
    assert not fd_leak["flat"]
    # roles that never had a process are left out of the per-role rows
    assert "rss_bytes.controller" not in report["metrics"]


def test_roles_name_each_ray_daemon():
    from expertmesh.ops.drill.resources import _role

    assert _role("ray::ExpertActor.forward") == "expert_actors"
    assert _role("ray::ServeReplica:expertmesh:router") == "router_replicas"
    assert _role("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=x") == "ray_gcs"
    assert _role("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x") \
        == "ray_raylet"
    assert _role("ray::DashboardAgent") == _role("python .../ray/dashboard/dashboard.py --host=x") == "ray_dashboard"
    assert _role("ray::IDLE") == "ray_other"
    assert _role("python -m expertmesh.ops.cli serve --port 0") == "serve_process"
    assert _role("python -m pytest") == "other"


def test_flatness_needs_samples():
    assert not flatness(_samples([1e6, 1e6]))["enough_samples"]
    assert not flatness([])["enough_samples"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="/proc sampling is Linux-only")
def test_sample_tree_reads_this_process_and_its_children():
    sample = sample_tree([os.getpid()])
    total_procs = sum(r["procs"] for r in sample["roles"].values())
    assert total_procs >= 1
    assert sum(r["rss_bytes"] for r in sample["roles"].values()) > 10 * 2**20  # a Python with pytest loaded
    assert sum(r["fds"] for r in sample["roles"].values()) >= 3
    assert sample_tree([2**31 - 1])["roles"]["other"]["procs"] == 0  # no such process: an empty sample


def _soak_record(rss: list[float], kv_free_at_end: int = 64) -> DrillRecord:
    data = json.loads(FIXTURE.read_text())
    data["options"]["kill"] = "none"
    data["kills"] = []
    rec = DrillRecord.from_dict(copy.deepcopy(data))
    span = rec.load_end - rec.t0
    rec.resources = _samples(rss, step=span / (len(rss) - 1))
    for s in rec.resources:
        s["t"] += rec.t0 - 1000.0
    for p in rec.polls:
        if p.ok:
            p.kv_blocks_total, p.kv_blocks_free, p.live_kv_caches = 64, 40, 4
    last = [p for p in rec.polls if p.ok][-1]
    last.kv_blocks_free, last.live_kv_caches = kv_free_at_end, 0
    return rec


def test_a_soak_report_has_flatness_and_kv_targets(tmp_path):
    report = build_report(_soak_record([400e6] * 20))
    targets = report["targets"]
    assert targets["resident_memory_flat_within_5pct"]["met"]
    assert targets["descriptors_flat_within_5pct"]["met"]
    assert targets["kv_blocks_all_free_at_end"] == {"value": 64, "met": True, "applicable": True}
    assert not targets["restored_within_15s"]["applicable"]  # nothing was killed
    assert report["resources"]["kv_blocks"]["min_free"] == 40
    md = markdown(report)
    assert "## Resources" in md and "rss_bytes.total" in md
    assert plot_resources(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_a_leaking_soak_fails_its_targets():
    report = build_report(_soak_record([400e6 * (1 + 0.01 * i) for i in range(20)], kv_free_at_end=60))
    targets = report["targets"]
    assert not targets["resident_memory_flat_within_5pct"]["met"]
    assert targets["descriptors_flat_within_5pct"]["met"]
    assert not targets["kv_blocks_all_free_at_end"]["met"]
    assert not report["all_targets_met"]


def test_an_old_record_without_samples_still_scores():
    report = build_report(DrillRecord.load(FIXTURE))
    assert report["resources"]["flatness"]["enough_samples"] is False
    assert "resident_memory_flat_within_5pct" not in report["targets"]


def test_chaos_and_soak_settings_are_checked():
    with pytest.raises(ValueError, match="kill: chaos needs a cluster"):
        DrillConfig(kill="chaos", target="127.0.0.1:1").validate()
    with pytest.raises(ValueError, match="sample_every"):
        DrillConfig(kill="none", sample_every=0).validate()
    DrillConfig(kill="none", target="127.0.0.1:1").validate()  # a soak may attach to a running server


def test_node_kills_are_scored_against_ten_seconds():
    data = json.loads(FIXTURE.read_text())
    rec = DrillRecord.from_dict(copy.deepcopy(data))
    report = build_report(rec)
    assert "node_restored_within_10s" not in report["targets"]  # actor kills only
    for kill in rec.kills:
        kill.mode = "node"
    report = build_report(rec)
    worst = max(k["restore_s"] for k in report["kills"])
    assert report["targets"]["node_restored_within_10s"] == {"value": worst, "met": worst <= 10.0,
                                                             "applicable": True}
