"""Load statistics of the routed experts: sliding-window token counts per shard and per replica, and the routing
health metrics computed from them. Pure (numpy / torch, no Ray); routers feed it, the controller merges it, the
placement planner and autoscaler read `LoadWindow.shard_load()` / `replica_load()`.

Definitions (per MoE layer unless said otherwise; "slots" = (token, top-k slot) assignments, so a token routed to
k experts counts once for each of them; dropped slots count nowhere):

- shard load: slots per (layer, expert) in the window. Replica load: slots an actor served (all its shards).
- load std: population standard deviation of the shard load across the experts of a layer; `load_cv` = std/mean.
- imbalance: max/mean of the shard load across the experts of a layer (1.0 = even, E/k = all on k experts);
  per GPU: max/mean of the load summed per GPU slot (`placement`: actor -> slot key, e.g. "node/gpu0"; actors
  missing from it are each their own slot, which is what CPU-only actors are). 0.0 when there was no load.
- routing entropy: mean over tokens of H(p) = -sum_e p_e ln p_e of the router's own distribution over all E
  experts (`Routing.probs`): the softmax for softmax routers (Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V2), the sigmoid
  scores normalised to sum 1 for sigmoid routers (DeepSeek-V3, GLM-4.5; the selection-only correction bias is not
  part of it), in nats (max ln E: a uniform gate); `routing_entropy_norm` divides by ln E.
- switch rate: along each sequence, the share of consecutive token pairs whose top-1 expert differs. Pairs cross
  step boundaries (a decode step's token is compared with the sequence's previous token), so it is exact for both
  prefill and decode.
- active-parameter density: mean over tokens and MoE layers of (distinct experts the token used) / E, i.e. the share
  of one layer's routed-expert parameters a token touches (k/E when nothing is dropped; shared experts and dense
  parts excluded). `expert_coverage`: mean over steps of (experts hit by at least one token of the step) / E, the
  share of a layer's routed-expert parameters one forward step reads (what memory bandwidth pays for).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from .load_stats_config import LoadStatsConfig  # noqa: F401  (re-exported; torch-free there for the configuration)

SNAPSHOT_VERSION = 1


# ---- pure metrics ------------------------------------------------------------------------------------------------


def imbalance(load: np.ndarray) -> np.ndarray:
    """max/mean along the last axis. load: [..., N] -> [...]; 0.0 where the mean is 0 (no load)."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean(axis=-1)
    peak = load.max(axis=-1)
    return np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 0.0)


def load_std(load: np.ndarray) -> np.ndarray:
    """Population std along the last axis. load: [..., N] -> [...]."""
    return np.asarray(load, dtype=np.float64).std(axis=-1)


def gpu_load(replica_load: dict[str, float], placement: dict[str, str] | None) -> dict[str, float]:
    """Sum replica load per GPU slot. placement: actor -> slot key; actors missing from it are their own slot.
    Slots named by the placement but without load appear with 0 (an idle GPU lowers the mean)."""
    placement = placement or {}
    out: dict[str, float] = {slot: 0.0 for slot in placement.values()}
    for actor, load in replica_load.items():
        slot = placement.get(actor, actor)
        out[slot] = out.get(slot, 0.0) + float(load)
    return out


def routing_entropy(probs: torch.Tensor) -> torch.Tensor:
    """probs: [T, E] the router's distribution (softmax, or normalised sigmoid scores) -> [T] entropy in nats
    (0 * ln 0 taken as 0)."""
    p = probs.float()
    return -(p * torch.log(p.clamp(min=1e-30))).sum(dim=-1)


def distinct_experts(experts: torch.Tensor) -> torch.Tensor:
    """experts: [T, k] expert ids (-1 = dropped) -> [T] number of distinct experts each token used."""
    s = experts.sort(dim=-1).values  # [T, k]
    used = (s >= 0).sum(dim=-1)
    repeats = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).sum(dim=-1)
    return used - repeats


def top1_switches(top1: torch.Tensor, lengths: list[int], previous: list[int]) -> tuple[int, int, list[int]]:
    """Top-1 expert changes along sequences laid out one after another on the token axis.

    top1: [T] top-1 expert per token (sequences concatenated, lengths[i] tokens each); previous[i]: the top-1
    expert of sequence i's previous token (-1: none, e.g. a fresh prompt). Returns (switches, pairs, last) where
    pairs counts consecutive token pairs, switches those whose top-1 differs, and last[i] is sequence i's newest
    top-1 (or previous[i] if it had no token this step).
    """
    assert top1.dim() == 1 and int(sum(lengths)) == top1.numel() and len(previous) == len(lengths)
    if top1.numel() == 0:
        return 0, 0, list(previous)
    prev = torch.empty_like(top1)
    prev[1:] = top1[:-1]
    lens = torch.tensor(lengths, dtype=torch.int64)  # host: statistics
    starts = torch.cumsum(lens, 0) - lens  # [B]
    nonempty = lens > 0
    prev[starts[nonempty]] = torch.tensor(previous, dtype=top1.dtype)[nonempty]  # host: statistics
    valid = (prev >= 0) & (top1 >= 0)  # a dropped top slot (-1) makes no pair
    switches = int((valid & (prev != top1)).sum())
    last_idx = (starts + lens - 1).clamp(min=0)
    last = torch.where(nonempty, top1[last_idx], torch.tensor(previous, dtype=top1.dtype))  # host: statistics
    return switches, int(valid.sum()), last.tolist()


def health(counts: dict, num_experts: int, placement: dict[str, str] | None = None) -> dict:
    """The routing health metrics from a snapshot's `counts` (see module docstring). Per-layer lists follow
    the snapshot's `layers`."""
    shard = np.asarray(counts["shard_load"], dtype=np.float64).reshape(len(counts["tokens"]), num_experts)
    tokens = np.asarray(counts["tokens"], dtype=np.float64)
    per_layer_imb = imbalance(shard) if shard.size else np.zeros(0)
    std = load_std(shard) if shard.size else np.zeros(0)
    mean = shard.mean(axis=-1) if shard.size else np.zeros(0)
    entropy = _ratio(np.asarray(counts["entropy_sum"], dtype=np.float64), tokens)
    pairs = np.asarray(counts["pairs"], dtype=np.float64)
    switch = _ratio(np.asarray(counts["switches"], dtype=np.float64), pairs)
    steps = np.asarray(counts["steps"], dtype=np.float64)
    coverage = _ratio(np.asarray(counts["hit_sum"], dtype=np.float64), steps * num_experts)
    gpus = gpu_load(counts["replica_load"], placement)
    total_tokens = float(tokens.sum())
    return {
        "load_std": _floats(std),
        "load_cv": _floats(_ratio(std, mean)),
        "imbalance_per_layer": _floats(per_layer_imb),
        "imbalance": float(per_layer_imb.max()) if per_layer_imb.size else 0.0,
        "gpu_load": {k: round(v, 3) for k, v in sorted(gpus.items())},
        "gpu_imbalance": float(imbalance(np.array(list(gpus.values())))) if gpus else 0.0,
        "routing_entropy": _floats(entropy),
        "routing_entropy_norm": _floats(entropy / math.log(num_experts)) if num_experts > 1 else _floats(entropy),
        "switch_rate": _floats(switch),
        "active_param_density": (float(np.sum(counts["distinct_sum"])) / (total_tokens * num_experts)
                                 if total_tokens else 0.0),
        "expert_coverage": _floats(coverage),
    }


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def _floats(values: Iterable[float]) -> list[float]:
    return [round(float(v), 6) for v in values]


# ---- the sliding window ------------------------------------------------------------------------------------------


@dataclass
class _Bucket:
    start: float
    shard: np.ndarray  # [L, E] slots
    tokens: np.ndarray  # [L] tokens routed
    entropy_sum: np.ndarray  # [L] sum over tokens of the gate entropy (nats)
    switches: np.ndarray  # [L]
    pairs: np.ndarray  # [L]
    distinct_sum: np.ndarray  # [L] sum over tokens of distinct experts used
    hit_sum: np.ndarray  # [L] sum over steps of experts hit
    steps: np.ndarray  # [L] steps (layer calls) seen
    replica: dict[str, float] = field(default_factory=dict)
    rerouted: int = 0
    degraded: int = 0
    identity: int = 0  # LongCat-Flash: slots an identity (zero-compute) expert took; no shard, no call


class LoadWindow:
    """Sliding-window counters for one router. Not thread-safe by itself: one forward thread records, readers take
    a snapshot (numpy sums over a few buckets; a torn read can only mix two adjacent steps' counts)."""

    def __init__(self, moe_layers: list[int], num_experts: int, top_k: int, config: LoadStatsConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        assert moe_layers and num_experts > 0 and 0 < top_k <= num_experts
        self.layers = list(moe_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts = num_experts
        self.top_k = top_k
        self.config = (config or LoadStatsConfig()).validate()
        self.clock = clock
        self.started = clock()
        self._buckets: deque[_Bucket] = deque()
        self._last_top1: dict[object, np.ndarray] = {}  # sequence key -> [L] last top-1 per layer row (-1: none)

    # ---- recording (the router's forward thread) -----------------------------------------------------------

    def _bucket(self) -> _Bucket:
        now = self.clock()
        start = now - (now - self.started) % self.config.bucket_s
        if not self._buckets or self._buckets[-1].start < start:
            n, e = len(self.layers), self.num_experts
            self._buckets.append(_Bucket(start, np.zeros((n, e)), *(np.zeros(n) for _ in range(7))))
        while self._buckets and self._buckets[0].start <= now - self.config.window_s:
            self._buckets.popleft()
        return self._buckets[-1]

    def record_dispatch(self, layer: int, expert_slots: np.ndarray, replica_slots: dict[str, int],
                        degraded: int = 0, rerouted: int = 0, identity: int = 0) -> None:
        """One layer call: expert_slots [E] slots per expert, replica_slots actor -> slots it served; identity:
        slots served by an identity expert on the router (in no shard's load: nothing to place or replicate)."""
        b = self._bucket()
        b.shard[self.row[layer]] += expert_slots
        for actor, n in replica_slots.items():
            b.replica[actor] = b.replica.get(actor, 0.0) + n
        b.degraded += degraded
        b.rerouted += rerouted
        b.identity += identity

    def record_routing(self, layer: int, experts: torch.Tensor, probs: torch.Tensor | None, lengths: list[int],
                       keys: list[object]) -> None:
        """The routing one step served at `layer` (see record_step). experts: [T, k], probs: [T, E] or None."""
        self.record_step([layer], experts[None], None if probs is None else probs[None], lengths, keys)

    def record_step(self, layers: list[int], experts: torch.Tensor, probs: torch.Tensor | None, lengths: list[int],
                    keys: list[object]) -> None:
        """The routing one step served at several MoE layers at once (vectorised over layers: a decode step of
        32 sequences on 4 layers costs a few hundred microseconds, not one loop per layer and sequence).

        experts: [n, T, k] (n = len(layers)); probs: [n, T, E] the router's distribution (Routing.probs) or None;
        sequences `keys` (any hashable identity that stays the same across a sequence's steps) laid out with
        `lengths` tokens each."""
        b = self._bucket()
        rows = np.array([self.row[layer] for layer in layers])
        # [n, T, k] (the router's are host tensors already); numpy: these arrays are tiny, and numpy's per-op cost
        # is a few times lower
        e = experts.cpu().numpy()
        n, tokens, _ = e.shape
        b.tokens[rows] += tokens
        b.steps[rows] += 1
        if tokens == 0:
            return
        s = np.sort(e, axis=-1)
        distinct = (s >= 0).sum(axis=(1, 2)) - ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).sum(axis=(1, 2))
        b.distinct_sum[rows] += distinct
        hit = np.zeros((n, self.num_experts + 1), dtype=bool)
        hit[np.arange(n)[:, None], (e + 1).reshape(n, -1)] = True  # column 0 collects dropped slots (-1)
        b.hit_sum[rows] += hit[:, 1:].sum(axis=1)
        if probs is not None:
            p = probs.float().cpu().numpy()
            b.entropy_sum[rows] += -(p * np.log(np.maximum(p, 1e-30))).sum(axis=(1, 2))
        # Top-1 switches along each sequence, the previous step's last token included.
        lens = np.asarray(lengths, dtype=np.int64)
        starts = np.cumsum(lens) - lens  # [B]
        nonempty = lens > 0
        none = np.full(len(self.layers), -1, dtype=np.int64)
        state = [self._last_top1.get(k) for k in keys]
        previous = np.stack([none if st is None else st for st in state])[:, rows].T  # [n, B]
        top1 = e[:, :, 0]  # [n, T]
        prev = np.empty_like(top1)
        prev[:, 1:] = top1[:, :-1]
        prev[:, starts[nonempty]] = previous[:, nonempty]
        valid = (prev >= 0) & (top1 >= 0)  # a dropped top slot (-1) makes no pair
        b.switches[rows] += (valid & (prev != top1)).sum(axis=1)
        b.pairs[rows] += valid.sum(axis=1)
        last = np.where(nonempty[None, :], top1[:, np.maximum(starts + lens - 1, 0)], previous)  # [n, B]
        for i, k in enumerate(keys):
            st = state[i]
            if st is None:
                st = self._last_top1[k] = none.copy()
            st[rows] = last[:, i]

    def forget(self, keys: Iterable[object]) -> None:
        """Drop the per-sequence state of sequences that ended."""
        for k in keys:
            self._last_top1.pop(k, None)

    def retain(self, live: set[object]) -> None:
        """Keep per-sequence state only for `live` keys."""
        for k in [k for k in self._last_top1 if k not in live]:
            del self._last_top1[k]

    @property
    def tracked_sequences(self) -> int:
        return len(self._last_top1)

    # ---- reading --------------------------------------------------------------------------------------------

    def _window(self) -> list[_Bucket]:
        now = self.clock()
        return [b for b in list(self._buckets) if b.start > now - self.config.window_s]

    def shard_load(self) -> np.ndarray:
        """[num_moe_layers, num_experts] float64: slots per shard in the window (row i = MoE layer self.layers[i])."""
        out = np.zeros((len(self.layers), self.num_experts))
        for b in self._window():
            out += b.shard
        return out

    def replica_load(self) -> dict[str, float]:
        """actor name -> slots it served in the window."""
        out: dict[str, float] = {}
        for b in self._window():
            for actor, n in b.replica.items():
                out[actor] = out.get(actor, 0.0) + n
        return out

    def counts(self) -> dict:
        buckets = self._window()
        n = len(self.layers)

        def total(name: str) -> list[float]:
            acc = np.zeros(n)
            for b in buckets:
                acc += getattr(b, name)
            return [float(v) for v in acc]

        return {
            "shard_load": self.shard_load().tolist(),
            "replica_load": self.replica_load(),
            **{name: total(name) for name in ("tokens", "entropy_sum", "switches", "pairs", "distinct_sum",
                                              "hit_sum", "steps")},
            "rerouted": int(sum(b.rerouted for b in buckets)),
            "degraded": int(sum(b.degraded for b in buckets)),
            "identity": int(sum(b.identity for b in buckets)),
        }

    def snapshot(self, placement: dict[str, str] | None = None, epoch: int | None = None) -> dict:
        """A plain JSON-able dict (format in the README, "Load statistics")."""
        counts = self.counts()
        covered = min(self.config.window_s, self.clock() - self.started)
        return {
            "version": SNAPSHOT_VERSION,
            "time": time.time(),
            "window_s": self.config.window_s,
            "covered_s": round(covered, 3),
            "layers": list(self.layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "epoch": epoch,
            "placement": dict(placement or {}),
            "counts": counts,
            "health": health(counts, self.num_experts, placement),
        }


def merge_snapshots(snapshots: list[dict]) -> dict | None:
    """Several routers' snapshots of the same model -> one: counts add up, health is recomputed from the sums
    (so means are token-weighted, not averages of averages). None for an empty list."""
    if not snapshots:
        return None
    first = snapshots[0]
    for s in snapshots[1:]:
        assert s["layers"] == first["layers"] and s["num_experts"] == first["num_experts"], "different models"
    counts: dict = {"replica_load": {}}
    for key in ("tokens", "entropy_sum", "switches", "pairs", "distinct_sum", "hit_sum", "steps"):
        counts[key] = [float(v) for v in np.sum([s["counts"][key] for s in snapshots], axis=0)]
    counts["shard_load"] = np.sum([s["counts"]["shard_load"] for s in snapshots], axis=0).tolist()
    for s in snapshots:
        for actor, n in s["counts"]["replica_load"].items():
            counts["replica_load"][actor] = counts["replica_load"].get(actor, 0.0) + n
    counts["rerouted"] = sum(s["counts"]["rerouted"] for s in snapshots)
    counts["degraded"] = sum(s["counts"]["degraded"] for s in snapshots)
    counts["identity"] = sum(s["counts"].get("identity", 0) for s in snapshots)  # older routers: none
    placement: dict[str, str] = {}
    for s in snapshots:
        placement.update(s.get("placement") or {})
    return {
        **{k: first[k] for k in ("version", "window_s", "layers", "num_experts", "top_k")},
        "time": max(s["time"] for s in snapshots),
        "covered_s": max(s["covered_s"] for s in snapshots),
        "epoch": max((s["epoch"] for s in snapshots if s.get("epoch") is not None), default=None),
        "routers": len(snapshots),
        "placement": placement,
        "counts": counts,
        "health": health(counts, first["num_experts"], placement),
    }
