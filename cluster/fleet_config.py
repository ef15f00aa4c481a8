"""The fleet simulator's settings and the breaker-window helper (cluster/fleet_sim.py runs them). Pure; no Ray."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .breaker import BreakerBoard, BreakerConfig, allow

STRATEGIES = ("none", "restart", "replan")
SERVING, DEAD, EJECTED, STOOD_IN, DEFERRED = range(5)  # an active GPU's actor
DEEPSEEK_V3_SHARD_BYTES = 3 * 7168 * 2048  # gate, up, down of one routed expert, fp8 (1 byte per weight)


@dataclass(frozen=True)
class FleetConfig:
    gpus: int = 512  # serving GPUs
    gpus_per_node: int = 8
    spare_nodes: int = 0  # idle servers kept as spares
    layers: int = 58  # MoE layers (DeepSeek-V3: 61 layers, first 3 dense)
    # MoE layers simulated (placement, load, shedding); None: all. Layers are independent in every policy here, so a
    # sample of them gives the same fractions at a fraction of the planner's time; weight loads still count all
    # `layers` (a GPU loads its shards of every layer).
    sim_layers: int | None = 8
    experts: int = 256
    top_k: int = 8
    extra_replica_fraction: float = 0.25  # sets slots_per_gpu when not given (ElasticConfig's default)
    slots_per_gpu: int | None = None
    shard_bytes: float = DEEPSEEK_V3_SHARD_BYTES
    days: float = 30.0
    strategy: str = "replan"
    tokens_per_s: float = 100_000.0  # fleet decode throughput at mean traffic
    diurnal: float = 0.3  # daily traffic swing: peak / mean - 1 (cluster/fleet_trace.py)
    mean_utilisation: float = 0.5  # mean replica load / capacity at mean traffic on the first placement
    stand_in_capacity: float = 0.1  # a stand-in replica's capacity / a GPU replica's (no GPU share left: assumed)
    cpus_per_actor: float = 8.0
    controller_node: int = 0
    rebalance_hours: float = 12.0  # the replan strategy's elastic step (the controller's runs every 10 s)
    rebalance_threshold: float = 1.15  # ElasticConfig.rebalance_threshold
    autoscale: bool = True  # replan: autoscale.decide sets the counts the planner places
    shed: bool = True
    call_gap_s: float = 0.05  # a router's calls to one replica: one per decode step
    call_timeout_s: float = 30.0  # FailoverConfig.call_timeout_s: how long a call to a lost node hangs
    seed: int = 0

    def validate(self) -> FleetConfig:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.sim_layers is not None and not 1 <= self.sim_layers <= self.layers:
            raise ValueError(f"sim_layers: must be in 1..layers={self.layers}, got {self.sim_layers!r}")
        for name in ("gpus", "gpus_per_node", "layers", "experts", "top_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be an integer ≥ 1, got {getattr(self, name)!r}")
        if self.gpus % self.gpus_per_node:
            raise ValueError(f"gpus: {self.gpus} is not whole servers of gpus_per_node={self.gpus_per_node}")
        if self.spare_nodes < 0 or not 0 <= self.controller_node < self.gpus // self.gpus_per_node:
            raise ValueError("spare_nodes: must be ≥ 0; controller_node: a serving server")
        if self.slots * self.gpus < self.experts:
            raise ValueError(f"slots_per_gpu: {self.gpus} GPUs x {self.slots} slots cannot hold {self.experts} experts")
        if not (self.days > 0 and self.tokens_per_s > 0 and 0 < self.mean_utilisation and self.rebalance_hours > 0):
            raise ValueError("days, tokens_per_s, mean_utilisation, rebalance_hours: must be > 0")
        return self

    @property
    def modelled_layers(self) -> int:
        return self.layers if self.sim_layers is None else self.sim_layers

    @property
    def slots(self) -> int:
        if self.slots_per_gpu is not None:
            return self.slots_per_gpu
        return max(1, math.ceil(self.experts * (1 + self.extra_replica_fraction) / self.gpus))


def breaker_window(cfg: BreakerConfig, call_gap_s: float, latency_s: float) -> float:
    """Seconds from a replica's death until the breaker refuses new calls to it, when calls start every call_gap_s
    and each fails latency_s after it starts (0: the process is gone; the call timeout: its node is)."""
    assert call_gap_s > 0 and latency_s >= 0
    board = BreakerBoard(cfg)
    recorded = 0  # calls whose failure has been recorded; call j fails at j x call_gap_s + latency_s
    for k in range(1_000_000):
        start = k * call_gap_s
        while recorded < k and recorded * call_gap_s + latency_s <= start:
            board.record("r", recorded * call_gap_s + latency_s, ok=False)
            recorded += 1
        ok, board.states["r"] = allow(cfg, board.get("r"), start)
        if not ok:
            return start
    raise AssertionError("breaker never opened")
