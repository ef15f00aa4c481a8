"""The drill's pure scoring (ops/drill/report.py) on records of real drills, like a pure policy on a fake clock.

Fixtures (tests/unit/fixtures/) are the drill_record.json of real short drills on the embedded model:
  drill_actor_wait.json     expertmesh drill --kill actor --every 6 --duration 14 --baseline 6 --concurrency 2
                            --max-tokens 8   (2 replicas per expert, wait policy: two kills, both restored)
  drill_actor_degrade.json  the same with --no-replica-policy degrade --replicas-per-expert 1 (perplexity passes)
Expected values are recomputed here from the record by the definitions, not by calling the scoring helpers;
edited copies check that a failed request, a changed output and an unrecovered kill are scored as such.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from expertmesh.ops.drill import DrillConfig, DrillRecord, build_report, serve_args, write_report
from expertmesh.ops.drill.render import markdown
from expertmesh.ops.drill.report import all_recovered
from expertmesh.router_service.config import MeshConfig

FIXTURES = Path(__file__).parent / "fixtures"
RECORDS = ("drill_actor_wait.json", "drill_actor_degrade.json")


def load(name: str) -> DrillRecord:
    return DrillRecord.load(FIXTURES / name)


@pytest.fixture(scope="module")
def wait_record() -> DrillRecord:
    return load("drill_actor_wait.json")


def by_hand_percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, frac = int(pos), pos - int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] * (1 - frac) + ordered[high] * frac


def first_event(record: DrillRecord, kind: str, actor: str, after: float) -> dict:
    return min((e for e in record.events if e["kind"] == kind and e["actor"] == actor and e["t"] >= after),
               key=lambda e: e["t"])


def restored_at(record: DrillRecord) -> float:
    """When the last kill of the record recovered: the last `restored` event of a killed actor."""
    return max(first_event(record, "restored", a, k.t)["t"] for k in record.kills for a in k.targets)


# ----------------------------------------------------------------------------------- the records as recorded


@pytest.mark.parametrize("name", RECORDS)
def test_request_counts_and_phases(name):
    record = load(name)
    report = build_report(record)
    requests = report["requests"]
    assert requests["sent"] == len(record.requests) > 0
    failed = [r for r in record.requests if r.code != "OK"]
    assert requests["failed"] == len(failed) and requests["succeeded"] == len(record.requests) - len(failed)
    assert sum(p["sent"] for p in requests["by_phase"].values()) == requests["sent"]

    # Phases by their definitions: baseline ended before the first kill; faults started before the last restore.
    recovered = restored_at(record)
    baseline = [r for r in record.requests if r.end < record.fault_start]
    faults = [r for r in record.requests if r.end >= record.fault_start and r.start < recovered]
    assert requests["by_phase"]["baseline"]["sent"] == len(baseline) > 0
    assert requests["by_phase"]["faults"]["sent"] == len(faults) > 0
    assert report["phases_s"]["faults"] == [round(record.fault_start - record.t0, 3),
                                            round(recovered - record.t0, 3)]
    assert report["tokens"]["generated"] == sum(len(r.tokens) for r in record.requests)
    assert report["warmup"]["requests"] == record.prompts == len(record.warm_requests)


def test_the_wait_drill_met_every_target(wait_record):
    report = build_report(wait_record)
    assert [k.targets for k in wait_record.kills] == [["expert-e6-r0"], ["expert-e6-r1"]]
    assert report["requests"]["failed"] == 0
    assert report["outputs"]["mismatches"] == 0 and report["outputs"]["unverified"] == 0
    assert report["outputs"]["prompts_with_reference"] == wait_record.prompts
    assert report["tokens"]["degraded"] == 0
    assert report["cluster"]["replicas_expected"] == 16
    assert report["all_targets_met"] and all(t["met"] for t in report["targets"].values())
    assert report["perplexity"] is None and report["drill"]["server_policy"] == "wait"


@pytest.mark.parametrize("name", RECORDS)
def test_each_kill_is_matched_to_its_own_actors_controller_events(name):
    record = load(name)
    report = build_report(record)
    assert len(report["kills"]) == len(record.kills) == 2  # at 0 s and 6 s of the 14 s fault phase
    for kill, scored in zip(record.kills, report["kills"]):
        (actor,) = kill.targets
        lost = first_event(record, "lost", actor, kill.t)
        restored = first_event(record, "restored", actor, lost["t"])
        next_kill = min((k.t for k in record.kills if k.t > kill.t and actor in k.targets), default=math.inf)
        assert kill.t <= lost["t"] < restored["t"] < next_kill
        assert scored["detect_s"] == round(lost["t"] - kill.t, 3)
        assert scored["restore_s"] == round(restored["t"] - kill.t, 3) <= 15
        assert scored["actors"][actor]["controller_restore_work_s"] == restored["detail"]["seconds"]
        assert scored["recovered_at_s"] == round(restored["t"] - record.t0, 3)
        assert scored["error"] is None
    assert all_recovered(record) == (True, restored_at(record))
    assert report["targets"]["restored_within_15s"]["met"]


@pytest.mark.parametrize("name", RECORDS)
def test_latency_percentiles_by_hand(name):
    record = load(name)
    report = build_report(record)
    recovered = restored_at(record)
    phases = {
        "baseline": [r for r in record.requests if r.end < record.fault_start],
        "faults": [r for r in record.requests if r.end >= record.fault_start and r.start < recovered],
        "after": [r for r in record.requests if r.end >= record.fault_start and r.start >= recovered],
    }
    for phase, requests in phases.items():
        seconds = [r.end - r.start for r in requests if r.code == "OK"]
        summary = report["latency_s"][phase]
        assert summary["requests"] == len(seconds)
        if not seconds:
            assert summary["p50_s"] is None
            continue
        assert summary["p50_s"] == round(by_hand_percentile(seconds, 50), 3)
        assert summary["p99_s"] == round(by_hand_percentile(seconds, 99), 3)
        assert summary["max_s"] == round(max(seconds), 3)
        assert summary["mean_s"] == round(sum(seconds) / len(seconds), 3)
    ratio = report["latency_s"]["faults"]["p99_s"] / report["latency_s"]["baseline"]["p99_s"]
    assert report["targets"]["p99_during_faults_le_3x_baseline"]["value"] == round(ratio, 3)


def test_timeline_buckets_every_token_and_each_kill(wait_record):
    timeline = build_report(wait_record)["timeline"]
    n = math.ceil(wait_record.load_end - wait_record.t0)
    assert timeline["t_s"] == list(range(n))
    in_window = sum(count for r in wait_record.requests for t, count in r.chunks
                    if 0 <= t - wait_record.t0 < n)
    assert sum(timeline["tokens_per_s"]) == in_window > 0
    assert [k[0] for k in timeline["kills_s"]] == [round(k.t - wait_record.t0, 3) for k in wait_record.kills]
    # Live replicas from events: 16, one down at each kill, back at each restore.
    assert [p[1] for p in timeline["live_replicas_from_events"]] == [16, 15, 16, 15, 16, 16]


def test_degrade_drill_reports_perplexity_by_phase():
    record = load("drill_actor_degrade.json")
    report = build_report(record)
    ppl = report["perplexity"]
    assert report["drill"]["server_policy"] == "degrade"
    assert not report["targets"]["identical_greedy_outputs"]["applicable"]
    base = [p["perplexity"] for p in record.ppl_passes if p["end"] < record.fault_start and p["perplexity"]]
    assert base and ppl["baseline"] == round(sum(base) / len(base), 3) and ppl["baseline_passes"] == len(base)
    assert len(ppl["passes"]) == len(record.ppl_passes)
    assert ppl["tokens"] == record.ppl_info["tokens"] and ppl["window"] == 256
    assert ppl["training_report_held_out_perplexity"] == record.training_ppl


def test_the_json_report_equals_a_rebuild_from_the_saved_record(wait_record, tmp_path):
    report = write_report(copy.deepcopy(wait_record), tmp_path)
    again = build_report(DrillRecord.load(tmp_path / "drill_record.json"))
    assert {k: v for k, v in report.items() if k not in ("files", "summary")} == again


# ------------------------------------------------------------------------------------------ edited records


def test_a_failed_request_is_scored_as_a_failure(wait_record):
    record = copy.deepcopy(wait_record)
    victim = next(r for r in record.requests if r.start >= record.fault_start and r.end < record.fault_end)
    victim.code, victim.tokens = "UNAVAILABLE", []
    report = build_report(record)
    assert report["requests"]["failed"] == 1 and report["requests"]["failed_by_code"] == {"UNAVAILABLE": 1}
    assert report["requests"]["by_phase"]["faults"]["failed_by_code"] == {"UNAVAILABLE": 1}
    assert report["targets"]["zero_failed_requests"] == {"value": 1, "met": False, "applicable": True}
    assert not report["all_targets_met"]



def test_a_failed_request_fails_a_router_drill_too(wait_record):
    """In-flight streams resume when a router replica dies (issue 18 item 11): a failure is a failure there too."""
    record = copy.deepcopy(wait_record)
    record.options["kill"] = "router"
    assert build_report(record)["targets"]["zero_failed_requests"] == {"value": 0, "met": True, "applicable": True}
    victim = next(r for r in record.requests if r.start >= record.fault_start and r.end < record.fault_end)
    victim.code, victim.tokens = "UNAVAILABLE", []
    report = build_report(record)
    assert report["targets"]["zero_failed_requests"] == {"value": 1, "met": False, "applicable": True}
    assert not report["all_targets_met"]
    assert sum(report["timeline"]["failures"]) == 1
    sent = len(record.requests)
    assert f"Sent {sent}, succeeded {sent - 1}, failed 1 {{'UNAVAILABLE': 1}}." in markdown(report)


def test_a_changed_greedy_output_is_a_mismatch(wait_record):
    record = copy.deepcopy(wait_record)
    victim = next(r for r in record.requests if r.start >= record.fault_start and r.code == "OK")
    victim.tokens = [t + 1 for t in victim.tokens]
    report = build_report(record)
    assert report["outputs"]["mismatches"] == 1 and report["outputs"]["mismatches_by_phase"] == {"faults": 1}
    assert report["outputs"]["examples"][0]["got"] == victim.tokens
    assert not report["targets"]["identical_greedy_outputs"]["met"] and not report["all_targets_met"]


def test_an_unrecovered_kill_is_scored_as_such(wait_record):
    record = copy.deepcopy(wait_record)
    (actor,) = record.kills[1].targets
    record.events = [e for e in record.events if not (e["kind"] == "restored" and e["actor"] == actor)]
    report = build_report(record)
    second = report["kills"][1]
    assert second["detect_s"] is not None and second["restore_s"] is None and second["recovered_at_s"] is None
    assert report["kills"][0]["restore_s"] is not None  # the other kill still recovered
    assert all_recovered(record) == (False, None)
    assert not report["targets"]["restored_within_15s"]["met"] and not report["all_targets_met"]
    # Without a recovery the fault phase runs to the end of the load, and the plot shows one replica down.
    assert report["phases_s"]["faults"][1] == round(record.load_end - record.t0, 3)
    assert report["requests"]["by_phase"]["after"]["sent"] == 0
    assert report["timeline"]["live_replicas_from_events"][-1][1] == 15


def test_events_after_the_same_actors_next_kill_belong_to_that_kill(wait_record):
    """Kill the first kill's actor again at the second tick, with its second loss and restore: each kill gets its
    own pair, and without the first pair the first kill does not borrow the second's."""
    record = copy.deepcopy(wait_record)
    first, second = record.kills
    (actor,) = first.targets
    record.kills[1].targets = [actor]
    record.events = [e for e in record.events if e["actor"] == actor] + [
        {"t": second.t + 0.2, "kind": "lost", "actor": actor, "detail": {}},
        {"t": second.t + 3.0, "kind": "restored", "actor": actor, "detail": {"seconds": 2.5, "node_id": "n"}},
    ]
    scored = build_report(record)["kills"]
    own = first_event(record, "restored", actor, first.t)
    assert scored[0]["restore_s"] == round(own["t"] - first.t, 3)
    assert (scored[1]["detect_s"], scored[1]["restore_s"]) == (0.2, 3.0)

    record.events = [e for e in record.events if e["t"] >= second.t]
    scored = build_report(record)["kills"]
    assert scored[0]["detect_s"] is None and scored[0]["restore_s"] is None
    assert scored[1]["restore_s"] == 3.0


def test_a_kill_that_failed_to_start_is_left_out_of_recovery(wait_record):
    record = copy.deepcopy(wait_record)
    record.kills[1].error, record.kills[1].targets = "RuntimeError: no actor", []
    report = build_report(record)
    assert report["kills"][1]["error"] == "RuntimeError: no actor" and "restore_s" not in report["kills"][1]
    assert all_recovered(record)[0]
    assert len(report["timeline"]["recovery_windows_s"]) == 1


def test_a_record_from_another_schema_is_refused(wait_record):
    data = wait_record.to_dict() | {"surprise": 1}
    with pytest.raises(TypeError, match="surprise"):
        DrillRecord.from_dict(data)


# ------------------------------------------------------------------------------------------------- render


def test_render_markdown_and_png(wait_record, tmp_path):
    record = copy.deepcopy(wait_record)
    record.requests[-1].code = "DEADLINE_EXCEEDED"  # a failure bar on the plot, a failure in the text
    report = write_report(record, tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "drill_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "drill_report.md").read_text()
    assert text.startswith("# expertmesh drill: kill actor\n")
    assert "| zero_failed_requests | 1 | **NO** |" in text
    for kill in report["kills"]:
        assert f"| {kill['index']} | {kill['t_s']} | actor | {kill['targets'][0]} | {kill['detect_s']} |" in text
    assert "![timeline](drill_timeline.png)" in text
    assert "target zero_failed_requests: 1 -> NOT met" in report["summary"]
    assert report["files"]["record"] == str(out / "drill_record.json")


# ------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("change, message", [
    ({"kill": "everything"}, "kill: must be one of"),
    ({"mesh": MeshConfig().replace(**{"failover.no_replica_policy": "retry"})},
     "mesh.failover.no_replica_policy: must be one of"),
    ({"every": 0}, "every: must be a positive number of seconds"),
    ({"duration": float("inf")}, "duration: must be a positive number of seconds"),
    ({"baseline": -1.0}, "baseline: must be a positive number of seconds"),
    ({"concurrency": 0}, "concurrency: must be >= 1"),
    ({"max_tokens": 0}, "max_tokens: must be >= 1"),
    ({"mesh": MeshConfig().replace(**{"experts.replicas_per_expert": 0})},
     "mesh.experts.replicas_per_expert: must be an integer ≥ 1"),
    ({"nodes": 0}, "nodes: must be >= 1"),
    ({"num_cpus": 0}, "num_cpus: must be >= 1"),
    ({"fraction": 0.0}, r"fraction: must be in \(0, 1\]"),
    ({"fraction": 1.5}, r"fraction: must be in \(0, 1\]"),
    ({"target": "127.0.0.1:9000", "kill": "router"}, "address: --kill router against --target needs --address"),
    ({"target": "127.0.0.1:9000", "kill": "node", "address": "auto"}, "kill: node needs a cluster the drill"),
    ({"address": "auto"}, "address: give --target too, or neither"),
    ({"admin_token": " "}, "admin_token: must not be blank"),
])
def test_drill_config_names_the_bad_field(change, message):
    DrillConfig().validate()
    with pytest.raises(ValueError, match=message):
        DrillConfig(**change).validate()


def test_drill_config_accepts_an_attach_and_round_trips():
    config = DrillConfig(target="127.0.0.1:9000", address="auto", kill="controller", every=5.0)
    config.validate()
    assert DrillConfig.from_dict(config.to_dict()) == config and not config.self_started
    with pytest.raises(ValueError, match="^every_s: not a drill setting"):
        DrillConfig.from_dict({"every_s": 5})


def test_serve_args_carry_the_self_started_servers_configuration_tree(tmp_path):
    mesh = MeshConfig().replace(**{"experts.replicas_per_expert": 1, "failover.no_replica_policy": "degrade",
                                   "router.transport": "grpc"})
    config = DrillConfig(mesh=mesh)
    path = tmp_path / "serve_config.json"
    assert serve_args(config, "127.0.0.1:6379", path) == ["--config", str(path), "--address", "127.0.0.1:6379"]
    assert MeshConfig.load(path) == mesh  # every setting of the tree reaches the server, not only three
    assert (config.replicas_per_expert, config.no_replica_policy, config.model_dir) == (1, "degrade", None)
    assert DrillConfig().replicas_per_expert == 2  # a drill's default: one kill never empties a shard


def test_the_admin_token_reaches_the_self_started_server_but_never_the_record(tmp_path):
    config = DrillConfig(admin_token="drill-admin")
    path = tmp_path / "serve_config.json"
    serve_args(config, "127.0.0.1:6379", path)
    assert MeshConfig.load(path).server.admin_token == "drill-admin"
    assert path.stat().st_mode & 0o777 == 0o600  # a secret on disk: its owner only
    recorded = json.dumps(config.to_dict())
    assert "drill-admin" not in recorded
    assert DrillConfig.from_dict(config.to_dict()).admin_token is None
    # A server tree that already holds one (a --config file) is recorded without it too.
    tree = DrillConfig(mesh=MeshConfig().replace(**{"server.admin_token": "from-file"}))
    assert "from-file" not in json.dumps(tree.to_dict())


def test_drill_config_reads_records_written_before_the_tree(tmp_path):
    old = {"kill": "actor", "model_dir": None, "replicas_per_expert": 1, "no_replica_policy": "degrade"}
    config = DrillConfig.from_dict(old)
    assert config.mesh.experts.replicas_per_expert == 1 and config.mesh.failover.no_replica_policy == "degrade"
    assert DrillConfig.from_dict(config.to_dict()) == config


def test_the_drills_held_out_text_is_the_training_scripts():
    """ops/train/corpus.py is the one split: load_held_out() reads exactly load_corpus()'s held-out files, in order."""
    from expertmesh.ops.train.corpus import load_corpus, load_held_out

    train, held, root = load_corpus()
    assert load_held_out() == (held, root)
    assert held and len(train) > 10 * len(held)  # about one file in 20 is held out


def test_a_stand_in_taking_over_the_lost_shards_counts_as_the_restore(wait_record):
    # A node lost with no spare capacity: no `restored` event, but a re-plan and the remap onto a stand-in.
    record = copy.deepcopy(wait_record)
    kill = record.kills[1]
    (actor,) = kill.targets
    lost = first_event(record, "lost", actor, kill.t)
    record.events = [e for e in record.events if not (e["kind"] == "restored" and e["actor"] == actor)]
    record.events += [
        {"t": lost["t"] + 0.01, "kind": "restore_replanned", "actor": actor,
         "detail": {"reason": "1 merged into 1", "deferred": [], "stand_ins": {"expert-s0": {"replaces": [actor]}}}},
        {"t": lost["t"] + 2.5, "kind": "remap", "actor": "expert-s0",
         "detail": {"epoch": 3, "added": ["expert-s0"], "retired": [actor], "ready_s": 2.4}}]
    second = build_report(record)["kills"][1]
    assert second["restore_s"] == round(lost["t"] + 2.5 - kill.t, 3)
    assert second["actors"][actor]["stood_in_by"] == ["expert-s0"]
    assert second["actors"][actor]["controller_restore_work_s"] == 2.4
    assert all_recovered(record)[0]


def test_the_drill_kills_in_the_mesh_its_flag_names(tmp_path):
    from expertmesh.ops.cli import build_parser
    from expertmesh.ops.commands.drill import config_from_args

    parser = build_parser()
    chat = config_from_args(parser.parse_args(["drill", "--target", "127.0.0.1:9000", "--address", "auto",
                                                "--mesh-id", "chat", "--out", str(tmp_path)]))
    chat.validate()
    assert (chat.names.namespace, chat.names.controller) == ("expertmesh-chat", "controller")
    assert chat.names.is_router_replica("SERVE_REPLICA::expertmesh-chat#router#abc")
    assert not chat.names.is_router_replica("SERVE_REPLICA::expertmesh#router#abc")  # the default mesh's router
    default = config_from_args(parser.parse_args(["drill", "--out", str(tmp_path)]))
    assert default.names.namespace == "expertmesh"
    assert not default.names.is_router_replica("SERVE_REPLICA::expertmesh-chat#router#abc")
    # A self-started server serves under the id the drill kills in (its tree carries it).
    path = tmp_path / "serve_config.json"
    serve_args(chat, "127.0.0.1:6379", path)
    assert MeshConfig.load(path).mesh.id == "chat"
    with pytest.raises(ValueError, match="^mesh.id: must be 1-40 lower-case"):  # as `serve --mesh-id` says it
        config_from_args(parser.parse_args(["drill", "--mesh-id", "Bad_Id"])).validate()
