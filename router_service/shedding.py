"""Overload shedding, the expert circuit breaker of the serving write-ups: when a shard (layer, expert) runs above its
replicas' capacity for a while, a bounded share of its tokens goes to each token's next-best expert, until the load
falls again.

Pure policy, no Ray: `ShedPolicy.observe` takes one expert round's offered load and returns how many slots to move
off each expert; `choose_shed_slots` says which slots (deterministically), and experts/gating.py:`move_slots`
moves them (the same machinery as the `degrade` no-replica policy). The dispatcher (router_service/dispatch.py)
wires the three together; the in-process reference given the same counts moves the same slots, so distributed ==
reference holds with shedding on.

Utilisation of a shard in one expert round (one MoE layer's dispatch of one step; with overlap, one micro-batch's)
is the slots the gate routed to it (before any shedding: the offered load, so shedding does not hide the demand
that triggered it) over its capacity, `live replicas x replica_tokens_per_step`. `replica_tokens_per_step` is a
configured figure: how many token slots one expert replica serves per step within the latency the operator wants
(measure it with `expertmesh bench shed`, or from `expertmesh_expert_seconds` against tokens per call).

State per shard, with a clock passed in (tests use a fake one):
- closed -> shedding: every round for `window_s` had utilisation > `threshold` (one round at or below resets it);
- shedding -> closed: every round for `off_window_s` had utilisation < `off_threshold` (hysteresis: off_threshold
  is below threshold, so a shard near the line does not flap);
- while shedding, a round moves min(excess, max_share x slots) of the shard's slots, where excess is what is
  above `threshold x capacity`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..experts.gating import Routing, move_slots
from .failover_config import ShedConfig  # noqa: F401  (defined there so the configuration imports no torch)


@dataclass
class LayerShedState:
    """One layer's shards: tensors over its E experts (NaN = not counting)."""

    above_since: torch.Tensor  # [E] float64 when utilisation went above threshold and stayed there
    below_since: torch.Tensor  # [E] float64 when a shedding shard went below off_threshold and stayed there
    shedding: torch.Tensor  # [E] bool
    utilisation: torch.Tensor  # [E] float64 of the last round (metrics)

    @classmethod
    def empty(cls, num_experts: int) -> LayerShedState:
        nan = torch.full((num_experts,), math.nan, dtype=torch.float64)  # host: policy state
        return cls(nan.clone(), nan.clone(), torch.zeros(num_experts, dtype=torch.bool),  # host: policy state
                   torch.zeros(num_experts, dtype=torch.float64))  # host: policy state


def decide(config: ShedConfig, now: float, offered: torch.Tensor, replicas: torch.Tensor,
           state: LayerShedState) -> tuple[torch.Tensor, LayerShedState]:
    """One expert round of one layer. offered: [E] int64 slots the gate routed to each expert; replicas: [E] live
    replicas of each shard (0: not this policy's business, the no-replica policy handles it).
    -> (shed [E] int64 slots to move off each expert this round, the new state)."""
    capacity = replicas.to(torch.float64) * config.replica_tokens_per_step  # [E]
    load = offered.to(torch.float64)  # [E]
    util = torch.where(capacity > 0, load / capacity.clamp(min=1), torch.zeros_like(load))  # [E]
    nan = torch.full_like(util, math.nan)
    above = util > config.threshold
    above_since = torch.where(above, torch.where(state.above_since.isnan(), torch.full_like(util, now),
                                                 state.above_since), nan)
    below = util < config.off_threshold
    below_since = torch.where(below & state.shedding, torch.where(state.below_since.isnan(),
                                                                  torch.full_like(util, now), state.below_since), nan)
    start = ~state.shedding & above & (now - above_since >= config.window_s)
    stop = state.shedding & below & (now - below_since >= config.off_window_s)
    shedding = (state.shedding | start) & ~stop & (capacity > 0)
    # A shard that stops shedding starts counting afresh; one that starts is no longer "below".
    below_since = torch.where(shedding, below_since, nan)
    excess = (load - torch.floor(config.threshold * capacity)).clamp(min=0)  # [E]
    bound = torch.floor(config.max_share * load)  # [E]
    shed = torch.where(shedding, torch.minimum(excess, bound), torch.zeros_like(load)).to(torch.int64)  # [E]
    return shed, LayerShedState(above_since, below_since, shedding, util)


def choose_shed_slots(routing: Routing, shed: torch.Tensor) -> torch.Tensor:
    """Which slots move: for each expert e with shed[e] > 0, the shed[e] slots routed to e whose tokens rank e
    lowest (smallest gate probability: the least output changes), ties to the earlier (token, slot).
    Deterministic in (routing, shed), so the reference given the same counts moves the same slots.
    routing.experts: [T, k]; shed: [E] int64 -> [T, k] bool."""
    assert routing.probs is not None, "shedding needs the gate probabilities"
    experts = routing.experts  # [T, k]
    shed = shed.to(experts.device)  # the policy's counts are host bookkeeping; the router's routing is too
    candidate = (experts >= 0) & (shed[experts.clamp(min=0)] > 0)  # [T, k]
    where = torch.nonzero(candidate)  # [n, 2] (token, slot), row-major: token order
    expert = experts[where[:, 0], where[:, 1]]  # [n]
    prob = routing.probs[where[:, 0], expert]  # [n]
    # Group by expert, lowest probability first inside a group, ties in (token, slot) order: two stable sorts.
    by_prob = torch.sort(prob, stable=True).indices  # [n]
    order = by_prob[torch.sort(expert[by_prob], stable=True).indices]  # [n]
    grouped = expert[order]  # [n] ascending
    # [n] position inside its group
    rank = torch.arange(grouped.numel(), device=grouped.device) - torch.searchsorted(grouped, grouped)
    pick = order[rank < shed[grouped]]
    move = torch.zeros_like(experts, dtype=torch.bool)  # [T, k]
    move[where[pick, 0], where[pick, 1]] = True
    return move


def apply_shed(routing: Routing, shed: torch.Tensor, targets: torch.Tensor) -> Routing:
    """routing with `shed` [E] slots moved off each expert to each chosen token's next-best expert among `targets`
    ([E] bool: live and not shedding itself), counted in `shed_per_token`. Unchanged when nothing is shed."""
    if not bool(shed.any()):
        return routing
    return move_slots(routing, choose_shed_slots(routing, shed), targets, "shed")


class ShedPolicy:
    """The policy's state for every MoE layer of one router, and the counters it exports."""

    def __init__(self, config: ShedConfig, num_experts: int):
        self.config = config.validate()
        self.num_experts = num_experts
        self.layers: dict[int, LayerShedState] = {}

    def observe(self, layer: int, now: float, offered: torch.Tensor, replicas: torch.Tensor) -> torch.Tensor:
        """offered, replicas: [E] -> shed [E] (see `decide`)."""
        state = self.layers.get(layer) or LayerShedState.empty(self.num_experts)
        shed, self.layers[layer] = decide(self.config, now, offered, replicas, state)
        return shed

    def shedding(self, layer: int) -> torch.Tensor:
        """[E] bool: the layer's shards shedding now (no replacement goes to them)."""
        state = self.layers.get(layer)
        if state is None:
            return torch.zeros(self.num_experts, dtype=torch.bool)  # host: policy state
        return state.shedding

    def gauges(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """layer -> (utilisation [E] of its last round, shedding [E] bool)."""
        return {layer: (s.utilisation, s.shedding) for layer, s in sorted(self.layers.items())}
