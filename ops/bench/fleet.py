"""`expertmesh bench fleet`: the fleet simulator (cluster/fleet_sim.py) over a grid of strategies, spare servers and
failure rates, plus its validation against the committed 2-node drill reports. Pure; no Ray, no cluster.

One run per (failure scale, strategy, spare servers): strategy none runs without spares (it has no controller to
use them); every run of one scale sees the same faults on the serving GPUs and the same routing-load trace (same
seed), so differences between strategies are the strategies'. The restore-time model is read from
docs/benchmarks/results/drills/ (cluster/fleet_model.from_reports) and the trace shape from the recorded routing
trace (cluster/fleet_trace.TraceShape.from_file). Writes one JSON object; `--chart` also draws the PNG
(`python -m expertmesh.ops.bench.fleet_chart RESULT.json OUT.png` redraws it).
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass

from ...cluster.fleet_failures import SOURCE, FailureModel, Fault, RepairHours, hazards_per_hour
from ...cluster.fleet_model import actor_restores, from_reports, load_report
from ...cluster.fleet_sim import STRATEGIES, FleetConfig, FleetSim
from ...cluster.fleet_trace import TraceShape
from .common import say_to_stderr


@dataclass(frozen=True)
class FleetParams:
    gpus: int = 512
    days: float = 30.0
    strategies: tuple[str, ...] = STRATEGIES
    spares: tuple[int, ...] = (0, 1)  # spare servers (of 8 GPUs)
    scales: tuple[float, ...] = (1.0, 10.0)  # x the published failure rates
    sim_layers: int = 8
    seed: int = 0
    chart: str | None = None

    @classmethod
    def from_args(cls, args) -> FleetParams:
        def numbers(flag: str, text: str, kind: type) -> tuple:
            try:
                values = tuple(kind(v) for v in text.split(","))
            except ValueError:
                raise SystemExit(f"{flag}: expected comma-separated {kind.__name__}s, got {text!r}") from None
            if any(v < 0 for v in values):
                raise SystemExit(f"{flag}: must be ≥ 0, got {text!r}")
            return values

        strategies = tuple(args.strategies.split(","))
        for s in strategies:
            if s not in STRATEGIES:
                raise SystemExit(f"--strategies: {s!r} is not one of {', '.join(STRATEGIES)}")
        params = cls(gpus=args.gpus, days=args.days, strategies=strategies,
                     spares=numbers("--spares", args.spares, int), scales=numbers("--scales", args.scales, float),
                     sim_layers=args.sim_layers, seed=args.seed, chart=args.chart)
        try:  # the first run's settings, checked before any work (errors name the field)
            FleetConfig(gpus=params.gpus, days=params.days, sim_layers=params.sim_layers).validate()
        except ValueError as exc:
            field, _, rest = str(exc).partition(": ")
            raise SystemExit(f"--{field.replace('_', '-')}: {rest}") from None
        return params


def validation() -> dict:
    """The simulator's restore time for the two 2-node drill scenarios against the committed reports: the actor
    drill (calibrated on its first three kills, checked on the other three) and node-no-spare (a node and the
    controller on it lost, no room: a stand-in)."""
    from ...cluster.fleet_trace import TraceShape as Shape

    uniform = Shape(0.0, 0.0)
    base = dict(layers=4, sim_layers=None, experts=8, top_k=2, slots_per_gpu=1, shard_bytes=3 * 64 * 128 * 4,
                days=1 / 24, strategy="restart", shed=False, autoscale=False)
    held_out = [a["restore_s"] for a in actor_restores(load_report("actor"))[3:]]
    faults = [Fault(15.0 + 10 * i, "software", g, 3600.0) for i, g in enumerate((6, 14, 1, 12, 7, 3))]
    actor = FleetSim(FleetConfig(gpus=16, gpus_per_node=8, **base), times=from_reports(actor_kills=slice(0, 3)),
                     shape=uniform, faults=faults).run()
    node_measured = load_report("node-no-spare")["kills"][0]["restore_s"]
    node = FleetSim(FleetConfig(gpus=8, gpus_per_node=4, controller_node=0, **base), times=from_reports(),
                    shape=uniform, faults=[Fault(15.0, "node", 0, 1e6)]).run()

    def row(sim: float, measured: float, how: dict) -> dict:
        return {"simulated_s": round(sim, 3), "measured_s": round(measured, 3),
                "error": round((sim - measured) / measured, 4), "within_30pct": abs(sim - measured) <= 0.3 * measured,
                "handled": how}

    return {"actor_kill": row(actor["restore"]["p50_s"], statistics.median(held_out), actor["handled"]),
            "node_kill_no_spare": row(node["restore"]["p50_s"], node_measured, node["handled"])}


def run_fleet_bench(params: FleetParams, verbose: bool = True) -> dict:
    say = say_to_stderr(verbose)
    started, cpu_started = time.perf_counter(), time.process_time()
    times = from_reports()
    shape = TraceShape.from_file()
    runs = []
    for scale in params.scales:
        for strategy in params.strategies:
            for spares in (params.spares if strategy != "none" else (0,)):
                cfg = FleetConfig(gpus=params.gpus, days=params.days, strategy=strategy, spare_nodes=spares,
                                  sim_layers=params.sim_layers, seed=params.seed)
                t0, cpu0 = time.perf_counter(), time.process_time()
                sim = FleetSim(cfg, times=times, shape=shape, failures=FailureModel(scale))
                out = sim.run()
                out["failure_scale"] = scale
                out["restore_samples_s"] = sorted(round(f.restore_s, 3) for f in sim.metrics.faults
                                                  if f.restore_s is not None)
                out["wall_s"] = round(time.perf_counter() - t0, 2)
                out["cpu_s"] = round(time.process_time() - cpu0, 2)  # wall time on a shared machine says little
                runs.append(out)
                say(f"{scale:g}x {strategy:8s} spares {spares * cfg.gpus_per_node:3d} GPUs: availability "
                    f"{out['availability']:.5f}, faults {out['faults']}, restore p50 "
                    f"{out['restore'].get('p50_s')} s ({out['wall_s']} s)")
    result = {
        "benchmark": "fleet",
        "params": {k: v for k, v in asdict(params).items() if k != "chart"},
        "model": {"layers": 58, "experts": 256, "top_k": 8, "shard_bytes": FleetConfig().shard_bytes,
                  "note": "DeepSeek-V3: 61 layers (first 3 dense) -> 58 MoE layers of 256 routed experts, top-8; "
                          "sim_layers of them simulated"},
        "failures": {"source": SOURCE, "per_hour": hazards_per_hour(), "repair_hours": asdict(RepairHours())},
        "restore_times": asdict(times),
        "trace_shape": asdict(shape),
        "validation": validation(),
        "runs": runs,
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(time.process_time() - cpu_started, 2),
    }
    if params.chart:
        from .fleet_chart import write_fleet_chart

        write_fleet_chart(result, params.chart)
    return result
