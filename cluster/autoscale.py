"""Per-expert autoscaling policy: how many replicas each shard should have. Pure (numpy); no Ray.

In the style of Ray Serve's autoscaling policy: `decide(ctx, state, config) -> (decision, state)`, the state passed
in and returned, time read only from `ctx.now`, so it is tested with a fake clock. The controller runs it once per
control interval, hands `decision.replicas` to the planner as the replica counts, places what fits, and calls
`ray.autoscaler.sdk.request_resources(bundles=[{"GPU": 1}] * decision.request_gpus)` (0 releases the request).

Rules, per shard (layer, expert), with r replicas and load x over the window (target t per replica):
- scale up when x / r > t x upscale_threshold, to ceil(x / t) replicas (each then carries ≤ t);
- scale down when even ceil(x / (t x downscale_threshold)) < r replicas would each carry ≤ t x downscale_threshold,
  and only after the shard has been that cold for downscale_delay_s without a break.
Hysteresis: downscale_threshold < 1 ≤ upscale_threshold, so a count reached by scaling up is never cold and a count
reached by scaling down is never hot at the same load: noise of less than that gap cannot flap.

Budget, per MoE layer (each GPU has slots_per_gpu slots in every layer, as in the planner): replicas in a layer never
exceed max_gpus x slots_per_gpu. Adds go to the hottest shards first (highest load per replica). Adds that fit in
the free slots of the `ctx.gpus` live GPUs are placed now; the rest, up to the budget, are pending and make the
policy ask for GPUs (so do adds that would put two replicas of a shard on one GPU: a shard has at most one replica
per GPU; and replicas that no longer fit after GPUs were lost): request_gpus = the GPUs the pool needs for placed +
pending replicas when that is more than `base_gpus` (what the cluster has without autoscaling) or than the GPUs alive
now, else 0, so a scale-down that brings the pool back within base_gpus releases the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .elastic_config import AutoscaleConfig  # noqa: F401  (re-exported; numpy-free there for the configuration)


@dataclass(frozen=True)
class AutoscaleContext:
    now: float  # seconds (monotonic; a fake clock in tests)
    load: np.ndarray  # [layers, experts] load per shard over the window, all replicas together
    replicas: np.ndarray  # [layers, experts] replicas each shard has now
    gpus: int  # live GPUs now


@dataclass(frozen=True)
class AutoscaleState:
    cold_since: np.ndarray | None = None  # [layers, experts] when the shard became cold; nan while it is not
    request_gpus: int = 0


@dataclass(frozen=True)
class AutoscaleDecision:
    replicas: np.ndarray  # [layers, experts] counts to plan with now (placed adds and removals applied)
    add: list[tuple[int, int, int]] = field(default_factory=list)  # (layer, expert, replicas to add now)
    remove: list[tuple[int, int, int]] = field(default_factory=list)  # (layer, expert, replicas to remove)
    pending: np.ndarray | None = None  # [layers, experts] replicas wanted that wait for GPUs
    request_gpus: int = 0  # GPU bundles to keep requested from Ray's autoscaler; 0 = release

    @property
    def changed(self) -> bool:
        return bool(self.add or self.remove)


def initial_state() -> AutoscaleState:
    return AutoscaleState()


def decide(ctx: AutoscaleContext, state: AutoscaleState, config: AutoscaleConfig
           ) -> tuple[AutoscaleDecision, AutoscaleState]:
    config.validate()
    load = np.asarray(ctx.load, dtype=np.float64)
    replicas = np.asarray(ctx.replicas, dtype=np.int64)
    assert load.ndim == 2 and load.shape == replicas.shape, "load, replicas: expected [layers, experts] each"
    assert np.isfinite(load).all() and (load >= 0).all(), "load: must be finite and ≥ 0"
    assert (replicas >= 1).all(), "replicas: every shard needs ≥ 1"
    assert ctx.gpus >= 1
    layers, experts = load.shape
    cap = min(config.max_replicas_per_shard, config.max_gpus)
    budget = config.max_gpus * config.slots_per_gpu
    target = config.target_load_per_replica

    hot = load / replicas > target * config.upscale_threshold
    want_up = np.clip(np.ceil(load / target), config.min_replicas, cap).astype(np.int64)
    up = np.where(hot, np.maximum(want_up - replicas, 0), 0)  # [L, E] replicas to add

    want_down = np.clip(np.ceil(load / (target * config.downscale_threshold)), config.min_replicas, cap)
    cold = (want_down < replicas) & ~hot
    cold_since = np.full(load.shape, np.nan) if state.cold_since is None else np.array(state.cold_since, float)
    assert cold_since.shape == load.shape, "state: from a model of another shape"
    cold_since = np.where(cold, np.where(np.isnan(cold_since), ctx.now, cold_since), np.nan)
    due = cold & (ctx.now - cold_since >= config.downscale_delay_s)
    down = np.where(due, replicas - want_down.astype(np.int64), 0)
    cold_since = np.where(due, np.nan, cold_since)  # the next step down waits a full delay again

    counts = replicas - down
    pending = np.zeros_like(counts)
    # GPUs lost since the last decision: what no longer fits (more replicas of a shard than live GPUs, more
    # replicas in a layer than live slots) waits as pending, the coldest replicas first.
    over = np.maximum(counts - ctx.gpus, 0)
    counts, pending = counts - over, pending + over
    excess = counts.sum(axis=1) - ctx.gpus * config.slots_per_gpu
    for layer in np.flatnonzero(excess > 0):
        for _ in range(int(excess[layer])):
            e = int(np.where(counts[layer] > 1, load[layer] / np.maximum(counts[layer] - 1, 1), np.inf).argmin())
            counts[layer, e] -= 1
            pending[layer, e] += 1
    down = down + (replicas - down - counts)
    add = np.zeros_like(counts)
    free = ctx.gpus * config.slots_per_gpu - counts.sum(axis=1)  # [L]
    room = budget - counts.sum(axis=1)
    placed_now = np.zeros(layers, dtype=np.int64)
    for layer in np.flatnonzero(up.sum(axis=1)):
        # Hottest first: one replica at a time to the shard with the highest load per replica.
        wanted = up[layer].copy()
        have = counts[layer].copy()
        placed = 0
        while wanted.any() and placed < max(room[layer], 0):
            per = np.where(wanted > 0, load[layer] / have, -np.inf)
            e = int(per.argmax())
            wanted[e] -= 1
            have[e] += 1
            # Placeable now: a free slot, and a live GPU without this shard (one replica per GPU at most).
            if placed_now[layer] < free[layer] and counts[layer, e] + add[layer, e] < ctx.gpus:
                add[layer, e] += 1
                placed_now[layer] += 1
            else:
                pending[layer, e] += 1
            placed += 1
    counts = counts + add
    wanted = counts + pending
    needed = int(max(max(math.ceil(s / config.slots_per_gpu) for s in wanted.sum(axis=1)), wanted.max()))
    # Held while the pool needs more than the base cluster or than the GPUs alive now (a lost node to replace).
    request = min(needed, config.max_gpus) if needed > min(config.base_gpus, ctx.gpus) else 0
    decision = AutoscaleDecision(
        replicas=counts,
        add=[(int(a), int(b), int(add[a, b])) for a, b in np.argwhere(add > 0)],
        remove=[(int(a), int(b), int(down[a, b])) for a, b in np.argwhere(down > 0)],
        pending=pending,
        request_gpus=request,
    )
    return decision, AutoscaleState(cold_since=cold_since, request_gpus=request)
