"""Predicting the next MoE layer's experts while the current layer runs, so expert actors with a memory budget can
load them ahead of the call (README: Offload). Pure: torch only, no Ray; the dispatcher (dispatch.py) turns a
prediction into hints for the actors hosting those shards.

Modes:
- "gate" (pre-gating): the hidden state entering the current layer's experts, put through the NEXT layer's router
  (its existing weights, no training): adjacent layers' inputs differ by one residual update, so the next layer's
  gate usually picks the same experts from either. The step's last MoE layer predicts the first one of the next
  step from history (no gate sees across a step).
- "history": the experts the next layer used the last time it ran (the previous step): decode steps of the same
  sequences route alike.

Recall (the share of the shards a layer then used that were predicted) is counted here, against the routing each
layer actually served. Which predictions become hints is router_service/prefetch_policy.py's decision (confidence
from the gate's probabilities, a per-layer shard budget, a floor on the measured precision).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from ..cluster.routing_table import Shard
from ..experts.setting_choices import PREFETCH_MODES, PREFETCH_SETTINGS  # noqa: F401  (PREFETCH_SETTINGS re-exported)
from .prefetch_governor import PrefetchGovernor
from .prefetch_policy import PrefetchPolicy, choose_experts, expert_confidence, precision_allows


class NextLayerPredictor:
    """gate(layer, hidden [T, H]) -> experts [T, k] that `layer`'s router would pick for these hidden states (only
    used in "gate" mode). gate_probs(layer, hidden) -> [T, E] the softmax of that router's logits: with it and a
    policy, gate-mode hints keep only confident experts (prefetch_policy.py); top_k: experts per token."""

    def __init__(self, mode: str, moe_layers: list[int],
                 gate: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                 policy: PrefetchPolicy | None = None,
                 gate_probs: Callable[[int, torch.Tensor], torch.Tensor] | None = None, top_k: int = 2,
                 governor: PrefetchGovernor | None = None):
        assert mode in PREFETCH_MODES and mode != "off", mode
        assert mode != "gate" or gate is not None, "gate mode needs the routers"
        self.policy = policy or PrefetchPolicy()
        # Hints only while they make decode steps faster (prefetch_governor.py); None: always. The dispatcher tells
        # it where steps begin and end.
        self.governor = governor
        self.governed = 0  # predictions the governor kept back (hints off in this step)
        self.gate_probs, self.top_k = gate_probs, top_k
        self.predictions = 0  # predict() calls that had something to go on (the precision floor's probe clock)
        self.withheld = 0  # of those, how many the precision floor kept back
        self.mode = mode
        self.layers = sorted(moe_layers)
        self.next_of = {a: b for a, b in zip(self.layers, self.layers[1:] + self.layers[:1])}
        self.gate = gate
        self.last_used: dict[int, set[int]] = {}  # layer -> experts it served the last time it ran
        self.pending: dict[int, set[int]] = {}  # layer -> experts predicted for its next run
        self.predicted = self.actual = self.hits = 0  # shard counts, for recall and precision

    def observe(self, layer: int, experts: torch.Tensor) -> None:
        """The experts [T, k] `layer` serves now (negative ids: dropped slots): scores the prediction made for it
        and becomes its history."""
        used = {int(e) for e in torch.unique(experts).tolist() if e >= 0}
        guess = self.pending.pop(layer, None)
        if guess is not None:
            self.predicted += len(guess)
            self.actual += len(used)
            self.hits += len(guess & used)
        self.last_used[layer] = used

    def predict(self, layer: int, hidden: torch.Tensor) -> tuple[int, list[int]] | None:
        """While `layer` computes on hidden [T, H]: (the next MoE layer, the experts it is predicted to use), or
        None when there is nothing to go on yet."""
        nxt = self.next_of.get(layer)
        if nxt is None or nxt == layer:
            return None
        if self.governor is not None and not self.governor.hinting:
            self.governed += 1
            self.pending.pop(nxt, None)  # nothing was predicted for it: score nothing
            return None
        wraps = nxt <= layer  # the next step's first MoE layer
        policy = self.policy
        if self.mode == "gate" and not wraps:
            if self.gate_probs is not None and (policy.min_confidence > 0 or policy.max_shards is not None):
                guess = set(choose_experts(expert_confidence(self.gate_probs(nxt, hidden), self.top_k), policy))
            else:
                guess = {int(e) for e in torch.unique(self.gate(nxt, hidden)).tolist() if e >= 0}
        elif nxt in self.last_used:  # history: no probability to threshold; the budget keeps the lowest ids
            guess = set(choose_experts(dict.fromkeys(self.last_used[nxt], 1.0), policy))
        else:
            return None
        self.predictions += 1
        if not precision_allows(self.hits, self.predicted, self.predictions, policy):
            self.withheld += 1
            return None
        self.pending[nxt] = guess
        return nxt, sorted(guess)

    def stats(self) -> dict:
        return {"mode": self.mode, "predicted_shards": self.predicted, "actual_shards": self.actual,
                "hit_shards": self.hits, "recall": self.hits / self.actual if self.actual else None,
                "precision": self.hits / self.predicted if self.predicted else None,
                "withheld_layers": self.withheld, "governed_layers": self.governed,
                "governor": None if self.governor is None else self.governor.stats()}


def address_hints(layer: int, experts: Sequence[int], replicas: Mapping[Shard, Sequence[str]],
                  dead: Collection[str]) -> dict[str, list[Shard]]:
    """A prediction (the next MoE layer and its experts) addressed to the live actors hosting those shards:
    actor -> [(layer, expert)], each actor's shards in the prediction's order."""
    hints: dict[str, list[Shard]] = {}
    for expert in experts:
        for actor in replicas.get((layer, expert), ()):
            if actor not in dead:
                hints.setdefault(actor, []).append((layer, expert))
    return hints


def prefetch_note(prefetcher: NextLayerPredictor | None) -> str:
    """RouterStats.prefetch: "" when off; "gate" (no governor); "gate, measuring"; "gate, hints on: 10.1 ms per
    sequence-row with them, 13.6 without, held 256 steps (40 done)" (the governor's last measurement and how long its
    verdict holds)."""
    if prefetcher is None:
        return ""
    governor = prefetcher.governor
    if governor is None:
        return prefetcher.mode
    last = governor.verdicts[-1] if governor.verdicts else None
    if last is None:
        return f"{prefetcher.mode}, measuring"
    state = "hints on" if governor.verdict else "hints off"
    again = (", measuring again" if governor.measuring else
             f", held {governor.hold} steps ({governor.held} done)")
    return (f"{prefetcher.mode}, {state}: {last['on_s_per_row'] * 1e3:.1f} ms per sequence-row with them, "
            f"{last['off_s_per_row'] * 1e3:.1f} without{again}")


def prefetch_gauge(prefetcher: NextLayerPredictor | None) -> float | None:
    """The `expertmesh_prefetch_hints` gauge: 1 while gate hints are sent (no governor, or its verdict is on), 0
    while the governor withholds them, -1 while it measures before its first verdict; None when prefetch is off."""
    if prefetcher is None:
        return None
    governor = prefetcher.governor
    if governor is None:
        return 1.0
    if not governor.verdicts:
        return -1.0
    return 1.0 if governor.verdict else 0.0
