"""The fleet simulator (cluster/fleet_*.py): validated against the committed 2-node drill reports, and its event loop
and metrics checked on tiny fleets whose answers are known by hand. No Ray, no torch (shedding off)."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from expertmesh.cluster.breaker import BreakerConfig
from expertmesh.cluster.fleet_config import FleetConfig, breaker_window
from expertmesh.cluster.fleet_failures import (
    EXPOSURE_GPU_HOURS,
    GPUS_PER_SERVER,
    UNEXPECTED,
    FailureModel,
    Fault,
    counts_by_scope,
    hazards_per_hour,
)
from expertmesh.cluster.fleet_metrics import shard_counts
from expertmesh.cluster.fleet_model import RestoreTimes, actor_restores, from_reports, load_report
from expertmesh.cluster.fleet_sim import FleetSim
from expertmesh.cluster.fleet_trace import FleetTrace, TraceShape, trace_shape

EMBEDDED_SHARD_BYTES = 3 * 64 * 128 * 4  # the drills' embedded model: H=64, I=128, fp32
UNIFORM = TraceShape(skew_cv=0.0, drift_cv=0.0)


def _drill_fleet(**kw) -> FleetConfig:
    """The drills' shape: the embedded model (4 MoE layers, 8 experts, top-2) on two nodes, one actor per device."""
    base = dict(layers=4, sim_layers=None, experts=8, top_k=2, slots_per_gpu=1, shard_bytes=EMBEDDED_SHARD_BYTES,
                days=1 / 24, strategy="restart", shed=False, autoscale=False)
    return FleetConfig(**{**base, **kw})


def test_actor_kill_restore_matches_the_actor_drill_within_30_percent():
    """Calibrated on the actor drill's first three kills (their restore work), checked against the other three's
    end-to-end restore times (detect + restore), which the calibration never saw."""
    report = load_report("actor")
    measured = [a["restore_s"] for a in actor_restores(report)[3:]]
    assert len(measured) >= 3
    times = from_reports(actor_kills=slice(0, 3))
    cfg = _drill_fleet(gpus=16, gpus_per_node=8)  # 8 experts x 2 replicas = 16 actors, as the drill
    faults = [Fault(15.0 + 10 * i, "software", g, 3600.0) for i, g in enumerate((6, 14, 1, 12, 7, 3))]
    out = FleetSim(cfg, times=times, shape=UNIFORM, faults=faults).run()
    assert out["handled"] == {"full": 6}  # each restored at its normal share, in place (its node is alive)
    sim = out["restore"]["p50_s"]
    held_out = statistics.median(measured)
    assert abs(sim - held_out) / held_out <= 0.30, (sim, held_out)


def test_node_kill_restore_matches_the_node_drill_within_30_percent():
    """node-no-spare: a node with 4 of the 8 actors (one replica each, no free room) removed, and the controller with
    it. Detection comes from Ray's health check and the controller drill's restart time, not from this drill."""
    report = load_report("node-no-spare")
    measured = report["kills"][0]["restore_s"]
    cfg = _drill_fleet(gpus=8, gpus_per_node=4, controller_node=0)
    out = FleetSim(cfg, times=from_reports(), shape=UNIFORM, faults=[Fault(15.0, "node", 0, 1e6)]).run()
    assert out["handled"] == {"stand_in": 1}  # the lost actors merged into a stand-in on the survivor, as the drill
    sim = out["restore"]["p50_s"]
    assert abs(sim - measured) / measured <= 0.30, (sim, measured)


def _hand_fleet(strategy: str, gpus: int, faults: list[Fault], times: RestoreTimes | None = None) -> dict:
    cfg = FleetConfig(gpus=gpus, gpus_per_node=gpus, layers=2, sim_layers=None, experts=8, top_k=2, slots_per_gpu=1,
                      shard_bytes=0.0, days=1 / 24, strategy=strategy, shed=False, autoscale=False, diurnal=0.0)
    return FleetSim(cfg, times=times or RestoreTimes(), shape=UNIFORM, faults=faults).run()


def test_no_faults_serves_everything():
    out = _hand_fleet("none", 8, [])
    assert out["availability"] == pytest.approx(1.0)
    assert out["fraction"] == {"degraded": 0.0, "shed": 0.0, "rerouted": 0.0, "late": 0.0}
    assert out["gpu_hours"] == {"serving": 8.0, "lost": 0.0, "idle": 0.0}


def test_none_degrades_a_sole_replica_until_repair():
    """8 GPUs, 8 experts of equal load, one replica each: GPU 3 lost for 1000 s of the hour degrades 1/8 of the
    slots for 1000 s; its GPU-hours are lost; it is restored by the repair."""
    out = _hand_fleet("none", 8, [Fault(100.0, "gpu", 3, 1000.0)])
    assert out["fraction"]["degraded"] == pytest.approx(1 / 8 * 1000 / 3600)
    assert out["fraction"]["rerouted"] == 0.0
    assert out["availability"] == pytest.approx(1 - 1 / 8 * 1000 / 3600)
    assert out["gpu_hours"]["lost"] == pytest.approx(1000 / 3600, abs=1e-3)
    assert out["restore"]["p50_s"] == pytest.approx(1000.0)
    assert out["covered"]["p50_s"] == pytest.approx(1000.0)


def test_none_reroutes_to_the_other_replica():
    """16 GPUs, 8 equal experts: two replicas each. A dead process (no controller) keeps its place in the table, so
    half of its expert's slots are rerouted to the other replica until it comes back; nothing is degraded."""
    out = _hand_fleet("none", 16, [Fault(100.0, "software", 5, 1000.0)])
    assert out["fraction"]["degraded"] == 0.0
    assert out["fraction"]["rerouted"] == pytest.approx(1 / 8 * 1 / 2 * 1000 / 3600)
    assert out["covered"]["p50_s"] == 0.0  # its shards never lost every replica


def test_restart_stands_in_for_a_lost_gpu_without_spares():
    times = RestoreTimes(check_interval_s=1e-9, stand_in_start_s=2.0)
    out = _hand_fleet("restart", 8, [Fault(100.0, "gpu", 3, 1000.0)], times)
    assert out["handled"] == {"stand_in": 1}
    assert out["restore"]["p50_s"] == pytest.approx(2.0, abs=1e-6)
    assert out["fraction"]["degraded"] == pytest.approx(1 / 8 * 2.0 / 3600, rel=1e-6)


def test_restart_uses_a_spare_when_there_is_one():
    times = RestoreTimes(check_interval_s=1e-9, actor_start_s=3.0)
    cfg = FleetConfig(gpus=8, gpus_per_node=8, spare_nodes=1, layers=2, sim_layers=None, experts=8, top_k=2,
                      slots_per_gpu=1, shard_bytes=0.0, days=1 / 24, strategy="restart", shed=False,
                      autoscale=False, diurnal=0.0)
    sim = FleetSim(cfg, times=times, shape=UNIFORM, faults=[Fault(100.0, "gpu", 3, 1000.0)])
    out = sim.run()
    assert out["handled"] == {"full": 1}
    assert out["restore"]["p50_s"] == pytest.approx(3.0, abs=1e-6)
    assert sim.active[8:].sum() == 1 and not sim.active[3]  # the actor moved to a spare GPU
    # 8 spares idle, then 7 after the restore, and GPU 3 back as a spare after its repair at 1100 s.
    assert out["gpu_hours"]["idle"] == pytest.approx((8 * 103 + 7 * (1100 - 103) + 8 * (3600 - 1100)) / 3600, abs=1e-3)


def test_replan_moves_lost_shards_onto_survivors():
    times = RestoreTimes(check_interval_s=1e-9, remap_s=5.0)
    out = _hand_fleet("replan", 16, [Fault(100.0, "gpu", 2, 10_000.0)], times)
    assert out["handled"] == {"remap": 1}
    assert out["restore"]["p50_s"] == pytest.approx(5.0, abs=1e-6)
    assert out["fraction"]["degraded"] == 0.0 and out["policy_calls"]["planner"] >= 2


def test_breaker_window_fail_fast_and_hanging_calls():
    cfg = BreakerConfig()  # trips at 5 consecutive failures
    assert breaker_window(cfg, 0.05, 0.0) == pytest.approx(5 * 0.05)
    assert breaker_window(cfg, 0.05, 30.0) == pytest.approx(30.0 + 4 * 0.05)


def test_published_rates():
    counts = counts_by_scope()
    assert sum(counts.values()) == UNEXPECTED == 419
    rates = hazards_per_hour()
    per_gpu = rates["gpu"] + rates["software"] + (rates["node"] + rates["network"]) / GPUS_PER_SERVER
    assert per_gpu * EXPOSURE_GPU_HOURS == pytest.approx(419)
    expected = FailureModel(scale=10).expected(512, 8, 30 * 86400)
    assert sum(expected.values()) == pytest.approx(10 * 419 * 512 * 30 / (16384 * 54))
    draws = [len(FailureModel(scale=10).sample(np.random.default_rng(s), 512, 8, 30 * 86400)) for s in range(40)]
    assert statistics.mean(draws) == pytest.approx(sum(expected.values()), rel=0.15)


def test_trace_shape_and_trace():
    crafted = {"layers": [0], "num_experts": 2,
               "sequences": [{"tokens": [{"experts": [[0]]}] * 4}, {"tokens": [{"experts": [[0]]}] * 4}]}
    shape = trace_shape(crafted)
    assert shape.skew_cv == pytest.approx(1.0)  # shares [1, 0]: std 0.5, mean 0.5
    assert shape.drift_cv == pytest.approx(0.0)  # every sequence the same
    trace = FleetTrace(TraceShape(1.1, 0.5), layers=3, experts=16, seed=1, diurnal=0.0)
    share, rate = trace.hour(5)
    assert share.shape == (3, 16) and np.allclose(share.sum(axis=1), 1.0) and rate == 1.0
    again, _ = FleetTrace(TraceShape(1.1, 0.5), layers=3, experts=16, seed=1, diurnal=0.0).hour(5)
    assert np.array_equal(share, again)  # deterministic in the seed


def test_shard_counts():
    slots = np.array([[[0, -1], [0, 1], [2, -1]]])  # [1 layer, 3 GPUs, 2 slots]
    assert shard_counts(slots, np.array([1.0, 1.0, 0.0]), 3).tolist() == [[2.0, 1.0, 0.0]]
    assert shard_counts(slots, np.array([0.5, 1.0, 1.0]), 3).tolist() == [[1.5, 1.0, 1.0]]


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="strategy"):
        FleetConfig(strategy="hope").validate()
    with pytest.raises(ValueError, match="gpus"):
        FleetConfig(gpus=12, gpus_per_node=8).validate()


def test_replan_with_an_in_place_restart_in_flight():
    """A dead process restarting in place keeps its shards through a re-plan for another GPU's fault; both faults
    end restored."""
    times = RestoreTimes(check_interval_s=1e-9, actor_start_s=10.0, remap_s=2.0)
    out = _hand_fleet("replan", 16, [Fault(100.0, "software", 1, 3600.0), Fault(100.5, "gpu", 2, 10_000.0)], times)
    assert out["handled"] == {"full": 1, "remap": 1}
    assert out["unrestored"] == 0
    assert out["restore"]["max_s"] == pytest.approx(10.0, abs=1e-6)


def test_bench_flags_are_checked_naming_the_flag():
    from argparse import Namespace

    from expertmesh.ops.bench.fleet import FleetParams

    good = dict(gpus=64, days=1.0, strategies="none,replan", spares="0,1", scales="1,10", sim_layers=4, seed=0,
                chart=None)
    assert FleetParams.from_args(Namespace(**good)).spares == (0, 1)
    for flag, value, message in (("spares", "x", "--spares"), ("gpus", 12, "--gpus"),
                                 ("strategies", "hope", "--strategies"), ("scales", "-1", "--scales")):
        with pytest.raises(SystemExit, match=message):
            FleetParams.from_args(Namespace(**{**good, flag: value}))
