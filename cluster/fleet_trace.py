"""Routing-load traces for the fleet simulator: skewed, drifting expert popularity per MoE layer. Pure (numpy).

Shape. The recorded routing trace (docs/benchmarks/results/offload/routing-trace.json: the embedded model's gate
decisions over held-out text, `expertmesh bench offload`) gives two numbers, measured by `trace_shape`:
- skew: the coefficient of variation (std / mean) of the experts' share of the routed slots in a layer, over the
  whole trace (about 1.1 there: a few experts take most slots);
- drift: the same per sequence against the whole (how far one stretch of traffic strays from the long-run mix),
  less the sampling noise of a sequence's few slots.
The synthetic trace keeps those two for any expert count: each layer's popularity is lognormal with the skew's CV
(sigma = sqrt(ln(1 + CV^2))), and a per-shard log-offset follows an AR(1) process, one step per hour, whose
stationary std has the drift's CV and whose correlation time is `drift_hours`. Traffic follows a daily cycle
(`diurnal`: peak/mean - 1). All of this is a model of the shape, not a recording of DeepSeek-V3's routing.

    trace = FleetTrace(TraceShape.from_file(), layers=58, experts=256, seed=0)
    share, rate = trace.hour(h)  # share: [layers, experts], rows sum to 1; rate: traffic x the mean
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RECORDED = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "results" / "offload" / "routing-trace.json"


@dataclass(frozen=True)
class TraceShape:
    skew_cv: float = 1.1  # CV of experts' long-run share in a layer
    drift_cv: float = 0.6  # CV of a stretch's share against the long-run one
    source: str = "defaults"

    @classmethod
    def from_file(cls, path: Path = RECORDED) -> TraceShape:
        with Path(path).open() as f:
            return trace_shape(json.load(f), source=_relative(path))


def trace_shape(trace: dict, source: str = "") -> TraceShape:
    """trace: a routing trace ({"layers", "num_experts", "sequences": [{"tokens": [{"experts": [[e, ...] per
    layer]}]}]}) -> its skew and drift CVs, averaged over layers (drift over shards with a non-zero share)."""
    layers, experts = len(trace["layers"]), int(trace["num_experts"])
    per_seq = []
    for seq in trace["sequences"]:
        counts = np.zeros((layers, experts))
        for token in seq["tokens"]:
            for layer, chosen in enumerate(token["experts"]):
                np.add.at(counts[layer], [e for e in chosen if e >= 0], 1)
        per_seq.append(counts)
    counts = np.stack(per_seq)  # [S, L, E]
    total = counts.sum(axis=0)  # [L, E]
    share = total / total.sum(axis=1, keepdims=True)
    skew = float(np.mean(share.std(axis=1) / share.mean(axis=1)))
    slots = counts.sum(axis=2, keepdims=True)  # [S, L, 1] routed slots of each sequence per layer
    seq_share = counts / np.maximum(slots, 1)  # [S, L, E]
    live = share > 0
    # A sequence's share is also a sample of few slots: take that binomial noise (share (1 - share) / slots) out of
    # the variance, so what is left is the traffic's own drift.
    noise = (share * (1 - share))[None] / np.maximum(slots, 1)  # [S, L, E]
    var = np.maximum(seq_share.var(axis=0) - noise.mean(axis=0), 0.0)  # [L, E]
    drift = float(np.mean(np.sqrt(var[live]) / share[live]))
    return TraceShape(skew, drift, source)


def _relative(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(RECORDED.parents[4]))
    except ValueError:
        return str(path)


def sigma_of_cv(cv: float) -> float:
    """The lognormal sigma whose CV is cv."""
    return math.sqrt(math.log1p(cv * cv))


class FleetTrace:
    """Hour by hour (sequential access, cached; asking for an earlier hour replays from the start)."""

    def __init__(self, shape: TraceShape, layers: int, experts: int, seed: int = 0, drift_hours: float = 6.0,
                 diurnal: float = 0.3):
        assert layers >= 1 and experts >= 1 and drift_hours > 0 and 0 <= diurnal < 1
        self.shape, self.layers, self.experts = shape, layers, experts
        self.seed, self.diurnal = seed, diurnal
        self.rho = math.exp(-1.0 / drift_hours)
        rng = np.random.default_rng(seed)
        self._base = rng.normal(0.0, sigma_of_cv(shape.skew_cv), (layers, experts))  # [L, E] log popularity
        self._drift_sigma = sigma_of_cv(shape.drift_cv)
        self._reset()

    def _reset(self) -> None:
        self._rng = np.random.default_rng([self.seed, 1])
        self._x = self._rng.normal(0.0, self._drift_sigma, (self.layers, self.experts))  # [L, E] stationary start
        self._at = 0

    def hour(self, h: int) -> tuple[np.ndarray, float]:
        """-> (share [layers, experts], each row summing to 1; traffic rate as a multiple of the mean)."""
        assert h >= 0
        if h < self._at:
            self._reset()
        innovation = self._drift_sigma * math.sqrt(1 - self.rho ** 2)
        while self._at < h:
            self._x = self.rho * self._x + self._rng.normal(0.0, innovation, self._x.shape)
            self._at += 1
        logits = self._base + self._x
        share = np.exp(logits - logits.max(axis=1, keepdims=True))
        share /= share.sum(axis=1, keepdims=True)
        rate = 1.0 + self.diurnal * math.sin(2 * math.pi * (h % 24) / 24)
        return share, rate
