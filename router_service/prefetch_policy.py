"""Which predicted experts are worth a prefetch (README: Offload): a prefetch moves a whole shard (33 MiB on the
benchmark model, ~336 MiB for Mixtral-8x7B in bf16) on a guess, and a wrong guess costs its bytes and may evict a
shard that a call then waits for. Pure: plain numbers and torch tensors, no Ray; tested in
tests/unit/test_prefetch_policy.py and replayed on the recorded routing trace by experts/eviction_sim.py.

- confidence (`experts.prefetch_min_confidence`): in gate mode, an expert is hinted only when some token gives it
  at least this probability under the next layer's gate (among that token's top-k picks). 0: every top-k pick.
- in-flight budget (`experts.prefetch_max_shards`): at most this many shards hinted per layer, most confident first
  (the actor's loader replaces hints not started yet with newer ones, so this bounds what one layer can queue).
- measured precision (`experts.prefetch_min_precision`): when the share of hinted shards that the layer then used
  falls below this, hints stop, except one layer in `PROBE_EVERY`, which keeps the measure alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROBE_EVERY = 8  # with precision below the floor, still hint one layer in this many (to keep measuring)


@dataclass(frozen=True)
class PrefetchPolicy:
    min_confidence: float = 0.0
    max_shards: int | None = None
    min_precision: float = 0.0

    def __post_init__(self) -> None:
        assert 0.0 <= self.min_confidence <= 1.0, self.min_confidence
        assert self.max_shards is None or self.max_shards >= 1, self.max_shards
        assert 0.0 <= self.min_precision <= 1.0, self.min_precision


def expert_confidence(probs: torch.Tensor, top_k: int) -> dict[int, float]:
    """probs [T, E] (each token's softmax over the next layer's experts) -> {expert: the highest probability any
    token gives it among its top_k picks}."""
    if probs.numel() == 0:
        return {}
    top = probs.float().topk(min(top_k, probs.shape[-1]), dim=-1)  # values, indices: [T, k]
    best: dict[int, float] = {}
    for e, p in zip(top.indices.reshape(-1).tolist(), top.values.reshape(-1).tolist()):
        if p > best.get(e, -1.0):
            best[e] = p
    return best


def choose_experts(confidence: dict[int, float], policy: PrefetchPolicy) -> list[int]:
    """The experts to hint: at least min_confidence, most confident first (ties: lower id), at most max_shards;
    returned sorted by id."""
    kept = sorted((e for e, p in confidence.items() if p >= policy.min_confidence),
                  key=lambda e: (-confidence[e], e))
    if policy.max_shards is not None:
        kept = kept[:policy.max_shards]
    return sorted(kept)


def precision_allows(hits: int, predicted: int, layers_seen: int, policy: PrefetchPolicy,
                     warm_up: int = 32) -> bool:
    """Whether to hint at this layer given the prediction's record so far (hits of predicted shards): always
    during the first `warm_up` predicted shards and when the floor is 0; below the floor, one layer in
    PROBE_EVERY."""
    if policy.min_precision <= 0.0 or predicted < warm_up:
        return True
    if hits / predicted >= policy.min_precision:
        return True
    return layers_seen % PROBE_EVERY == 0
