"""What the fleet simulator counts, and the per-segment arithmetic behind it. Pure (numpy).

Between two events the fleet's state is constant, so each quantity is a rate times the segment's length. Units:
a *slot* is one (token, MoE layer, top-k choice) routed to an expert; a *token-step* below means such a slot.

- total: slots offered (the gate's choices).
- degraded: slots of a shard with no live replica (the `degrade` no-replica policy sends them to the token's
  next-best expert; under `wait` they stall: either way not served by their expert when asked).
- shed: slots the overload-shedding policy moved to the next-best expert (router_service/shedding.py).
- rerouted: slots whose routing table still names a dead replica, served instead by a live replica of the same shard
  (retried after a failed call while the breaker is closed, then skipped): full precision, later or elsewhere.
- late: slots above a shard's live capacity after shedding (they queue: full precision, slower).
- availability = (total - degraded - shed) / total: the fraction of slots served by their own expert at full
  precision.
- GPU-hours lost: GPUs down (hardware) or hosting a dead actor, while in the fleet; GPU-hours idle: healthy GPUs
  out of the fleet (spares, and repaired GPUs waiting for the next elastic step to take them back).
- restore times: per fault, from the fault until every replica it took is serving again (restored, stood in for,
  remapped or repaired), and `covered_s`, until every shard it hit has a live replica again (0 when each kept one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def shard_counts(slots: np.ndarray, weight: np.ndarray, experts: int) -> np.ndarray:
    """slots: [layers, gpus, slots_per_gpu] expert ids (-1 empty); weight: [gpus] what each GPU's replicas count
    (0 = not at all) -> [layers, experts] sum of weight over the GPUs hosting each shard."""
    layers, gpus, per = slots.shape
    assert weight.shape == (gpus,), "weight: one per GPU"
    w = np.broadcast_to(weight[None, :, None], slots.shape)
    ok = (slots >= 0) & (w != 0)
    index = (np.arange(layers)[:, None, None] * experts + slots)[ok]
    return np.bincount(index, weights=w[ok], minlength=layers * experts).reshape(layers, experts)


def segment_rates(offered: np.ndarray, table: np.ndarray, dead_in_table: np.ndarray, live: np.ndarray,
                  capacity: np.ndarray, shed: np.ndarray) -> dict[str, float]:
    """Slots per second of one segment. All [layers, experts]: offered slots/s; table: replicas the routing table
    names; dead_in_table: of those, dead; live: replicas serving; capacity: slots/s the live replicas can take;
    shed: slots/s the shedding policy moves off each shard."""
    none_live = live <= 0
    degraded = float(offered[none_live].sum())
    kept = np.where(none_live, 0.0, offered - shed)  # [L, E] served by their own expert
    dead_share = np.where(table > 0, dead_in_table / np.maximum(table, 1), 0.0)
    rerouted = float((kept * dead_share).sum())
    late = float(np.maximum(kept - capacity, 0.0)[~none_live].sum())
    return {"total": float(offered.sum()), "degraded": degraded, "shed": float(shed[~none_live].sum()),
            "rerouted": rerouted, "late": late}


@dataclass
class FaultRecord:
    t_s: float
    scope: str
    gpus: int  # GPUs it took
    how: str = ""  # how it was handled: full, stand_in, deferred, remap, repair, none
    restore_s: float | None = None  # until every replica it took serves again
    covered_s: float = 0.0  # until every shard it hit has a live replica again
    degraded_shards: int = 0  # shards left with no live replica


@dataclass
class FleetMetrics:
    slots: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("total", "degraded", "shed", "rerouted", "late"), 0.0))
    gpu_hours_lost: float = 0.0
    gpu_hours_spare: float = 0.0
    gpu_hours_serving: float = 0.0
    faults: list[FaultRecord] = field(default_factory=list)
    plans: int = 0  # planner runs
    restore_plans: int = 0  # lost_restore.plan_restore runs
    autoscale_decisions: int = 0
    shed_segments: int = 0  # segments in which some shard shed

    def add(self, rates: dict[str, float], seconds: float, lost_gpus: float, spare_gpus: float,
            serving_gpus: float) -> None:
        for key, value in rates.items():
            self.slots[key] += value * seconds
        hours = seconds / 3600
        self.gpu_hours_lost += lost_gpus * hours
        self.gpu_hours_spare += spare_gpus * hours
        self.gpu_hours_serving += serving_gpus * hours

    def summary(self) -> dict:
        s = self.slots
        total = max(s["total"], 1e-300)
        restores = np.array([f.restore_s for f in self.faults if f.restore_s is not None], dtype=np.float64)
        covered = np.array([f.covered_s for f in self.faults], dtype=np.float64)

        def dist(x: np.ndarray) -> dict:
            if not len(x):
                return {"count": 0}
            q = np.percentile(x, [50, 90, 99])
            return {"count": len(x), "mean_s": round(float(x.mean()), 3), "p50_s": round(float(q[0]), 3),
                    "p90_s": round(float(q[1]), 3), "p99_s": round(float(q[2]), 3), "max_s": round(float(x.max()), 3)}

        by_how: dict[str, int] = {}
        for f in self.faults:
            by_how[f.how] = by_how.get(f.how, 0) + 1
        return {
            "availability": (s["total"] - s["degraded"] - s["shed"]) / total,
            "slots": {k: float(v) for k, v in s.items()},
            "fraction": {k: float(v) / total for k, v in s.items() if k != "total"},
            "faults": len(self.faults),
            "faults_by_scope": _count(f.scope for f in self.faults),
            "handled": by_how,
            "unrestored": sum(1 for f in self.faults if f.restore_s is None),
            "restore": dist(restores),
            "covered": dist(covered),
            "gpu_hours": {"serving": round(self.gpu_hours_serving, 3), "lost": round(self.gpu_hours_lost, 3),
                          "idle": round(self.gpu_hours_spare, 3)},
            "policy_calls": {"planner": self.plans, "plan_restore": self.restore_plans,
                             "autoscale": self.autoscale_decisions, "segments_shedding": self.shed_segments},
        }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out
