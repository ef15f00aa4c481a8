"""`expertmesh plan`: offline placement from a load file. Pure numpy; no Ray.

LOAD.json is either {"load": [[...], ...]} (one row per MoE layer, one number per expert: tokens or token-slots
over a window, e.g. LoadWindow.shard_load()) or that nested list alone. The placement JSON format is
cluster/shard_placement.Placement.to_json (see the README).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..cluster.planner import plan
from ..cluster.shard_placement import Placement, Topology, moves


def read_load(path: str) -> np.ndarray:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--load: cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--load: {path} is not JSON ({exc})") from exc
    rows = doc.get("load") if isinstance(doc, dict) else doc
    if rows is None:
        raise ValueError(f"--load: {path} has no \"load\" key")
    try:
        load = np.array(rows, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--load: {path}: load must be a [layers][experts] list of numbers") from exc
    if load.ndim != 2 or load.size == 0:
        raise ValueError(f"--load: {path}: load must be a non-empty [layers][experts] list of numbers, "
                         f"got shape {list(load.shape)}")
    return load


def run_plan(load_path: str, gpus: int, slots_per_gpu: int, nodes: int = 1, current_path: str | None = None,
             out_path: str | None = None, extra_replicas: int | None = None, failed_gpus: list[int] | None = None,
             balance_slack: float = 0.0) -> tuple[Placement, dict]:
    if nodes < 1 or gpus < 1 or gpus % nodes:
        raise ValueError(f"--gpus: {gpus} GPUs do not split evenly over --nodes {nodes}")
    if balance_slack < 0:
        raise ValueError(f"--balance-slack: must be ≥ 0, got {balance_slack}")
    load = read_load(load_path)
    topology = Topology(nodes, gpus // nodes, slots_per_gpu, frozenset(failed_gpus or []))
    current = None
    if current_path is not None:
        try:
            current = Placement.loads(Path(current_path).read_text())
        except OSError as exc:
            raise ValueError(f"--current: cannot read {current_path}: {exc.strerror}") from exc
        except ValueError as exc:
            raise ValueError(f"--current: {current_path}: {exc}") from exc
        if (current.layers, current.experts) != load.shape:
            raise ValueError(f"--current: placement of {current.layers} layers x {current.experts} experts, "
                             f"the load is {load.shape[0]} x {load.shape[1]}")
    start = time.perf_counter()
    new = plan(load, topology, current=current, extra_replicas=extra_replicas, balance_slack=balance_slack)
    elapsed = time.perf_counter() - start
    before = current if current is not None else Placement.round_robin(topology, *load.shape)
    if out_path:
        Path(out_path).write_text(new.dumps())
    summary = {
        "layers": load.shape[0], "experts": load.shape[1], "gpus": gpus, "nodes": nodes,
        "slots_per_gpu": slots_per_gpu, "failed_gpus": sorted(topology.failed_gpus),
        "replicas": new.total_replicas(),
        "extra_replicas_pct": round(100 * (new.total_replicas() / load.size - 1), 1),
        "before": "current" if current is not None else "one replica per expert, round-robin",
        # A current placement is measured as it was (GPUs that failed since still count).
        "max_over_mean_before": [round(float(x), 4) for x in before.imbalance(load)],
        "max_over_mean_after": [round(float(x), 4) for x in new.imbalance(load)],
        "moves": moves(current, new) if current is not None else None,
        "plan_ms": round(elapsed * 1e3, 1), "out": out_path,
    }
    return new, summary


def format_summary(s: dict) -> str:
    lines = [f"{s['layers']} layers x {s['experts']} experts on {s['gpus']} GPUs ({s['nodes']} nodes, "
             f"{s['slots_per_gpu']} slots/GPU/layer): {s['replicas']} replicas (+{s['extra_replicas_pct']}%), "
             f"planned in {s['plan_ms']} ms"]
    if s["moves"] is not None:
        lines.append(f"moves from current: {s['moves']} shard replicas to load")
    lines.append(f"max/mean GPU load per layer ({s['before']} -> plan):")
    for i, (a, b) in enumerate(zip(s["max_over_mean_before"], s["max_over_mean_after"])):
        lines.append(f"  layer {i:>3}: {a:7.3f} -> {b:7.3f}")
    if s["out"]:
        lines.append(f"wrote {s['out']}")
    return "\n".join(lines)
