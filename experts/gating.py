"""Top-k gating: softmax over the router logits, top-k with deterministic tie-breaking, optional renormalisation,
and an optional per-expert capacity that moves overflow to each token's next-best expert with room.

Pure torch; no Ray. The router and the in-process reference share it, so they route identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DROPPED = -1  # expert id of a slot that found no expert with room (capacity on, every candidate full)


@dataclass(frozen=True)
class Routing:
    experts: torch.Tensor  # [T, k] int64 expert ids; DROPPED where a slot was dropped
    weights: torch.Tensor  # [T, k] float32 combine weights; 0 for dropped slots
    rerouted: int = 0  # slots sent to a lower-ranked expert because their choice was full
    dropped: int = 0  # slots with no expert left
    rerouted_per_token: torch.Tensor | None = None  # [T] int64, with a capacity cap; None without one
    probs: torch.Tensor | None = None  # [T, E] float32 gate probabilities (for degraded re-routing)
    degraded_per_token: torch.Tensor | None = None  # [T] int64 slots moved off an expert with no live replica

    @property
    def degraded(self) -> int:
        return 0 if self.degraded_per_token is None else int(self.degraded_per_token.sum())

    @property
    def num_tokens(self) -> int:
        return self.experts.shape[0]

    def tokens_per_expert(self, num_experts: int) -> torch.Tensor:
        """[E] int64: how many (token, slot) assignments each expert received."""
        ids = self.experts[self.experts != DROPPED]
        return torch.bincount(ids, minlength=num_experts)


def preference_order(probs: torch.Tensor) -> torch.Tensor:
    """[T, E] probs -> [T, E] expert ids, best first. Equal probabilities keep the lower expert id first.

    A stable descending sort gives that tie-break; torch.topk promises no order among ties.
    """
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices


def route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    capacity_factor: float | None = None,
) -> Routing:
    """router_logits: [T, E] -> Routing over k slots per token.

    capacity_factor None (default) never drops or moves a token. Otherwise each expert takes at most
    ceil(capacity_factor * T * k / E) slots per call; slots are filled rank by rank (every token's first choice before
    any second choice), tokens in order, so the result does not depend on anything but the logits.
    """
    assert router_logits.dim() == 2, "router_logits must be [T, E]"
    num_tokens, num_experts = router_logits.shape
    assert 0 < top_k <= num_experts, f"top_k={top_k} must be in 1..{num_experts}"
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    order = preference_order(probs)  # [T, E]
    if capacity_factor is None:
        experts = order[:, :top_k].contiguous()  # [T, k]
        rerouted = dropped = 0
    else:
        if not (capacity_factor > 0 and math.isfinite(capacity_factor)):
            raise ValueError(f"capacity_factor must be a positive finite number, got {capacity_factor}")
        capacity = max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))
        experts, rerouted_per_token = _fill_with_capacity(order, top_k, capacity)
        rerouted, dropped = int(rerouted_per_token.sum()), int((experts == DROPPED).sum())
    weights = torch.gather(probs, 1, experts.clamp(min=0))  # [T, k]
    weights = torch.where(experts == DROPPED, torch.zeros_like(weights), weights)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
    return Routing(experts=experts, weights=weights, rerouted=rerouted, dropped=dropped,
                   rerouted_per_token=None if capacity_factor is None else rerouted_per_token, probs=probs)


def route_topk_softmax(
    router_logits: torch.Tensor, top_k: int, capacity_factor: float | None = None
) -> Routing:
    """gpt-oss: top-k on the router logits (bias already added), then softmax over the k chosen logits.

    router_logits: [T, E] -> Routing over k slots. Ties keep the lower expert id first, as in `route`. The weights
    equal softmax-then-renormalise mathematically; they are computed as transformers does (a softmax over the k
    logits). `probs` is the softmax over all E logits: degraded re-routing and load statistics rank by it, and
    renormalising its entries over any k experts gives that k's weights. With a capacity cap the softmax runs over
    the slots that found room (a dropped slot weighs 0).
    """
    assert router_logits.dim() == 2, "router_logits must be [T, E]"
    num_tokens, num_experts = router_logits.shape
    assert 0 < top_k <= num_experts, f"top_k={top_k} must be in 1..{num_experts}"
    logits = router_logits.float()  # [T, E]
    order = preference_order(logits)  # [T, E]
    if capacity_factor is None:
        experts = order[:, :top_k].contiguous()  # [T, k]
        rerouted = dropped = 0
        rerouted_per_token = None
    else:
        if not (capacity_factor > 0 and math.isfinite(capacity_factor)):
            raise ValueError(f"capacity_factor must be a positive finite number, got {capacity_factor}")
        capacity = max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))
        experts, rerouted_per_token = _fill_with_capacity(order, top_k, capacity)
        rerouted, dropped = int(rerouted_per_token.sum()), int((experts == DROPPED).sum())
    chosen = torch.gather(logits, 1, experts.clamp(min=0))  # [T, k]
    chosen = chosen.masked_fill(experts == DROPPED, float("-inf"))
    weights = torch.softmax(chosen, dim=-1)  # [T, k]
    weights = torch.nan_to_num(weights, nan=0.0)  # a token with every slot dropped: all weights 0
    return Routing(experts=experts, weights=weights, rerouted=rerouted, dropped=dropped,
                   rerouted_per_token=rerouted_per_token, probs=torch.softmax(logits, dim=-1))


def degrade(routing: Routing, available: torch.Tensor) -> Routing:
    """Move every slot whose expert is unavailable to the token's next-best available expert it does not already
    use; the token's weights are then rescaled to their original total. available: [E] bool.

    Used when no replica of a shard is alive and the operator chose to degrade rather than wait. A slot with no
    available expert left is dropped (weight 0).
    """
    assert routing.probs is not None, "degrade needs the gate probabilities"
    experts = routing.experts.clone()  # [T, k]
    lost = (experts >= 0) & ~available[experts.clamp(min=0)]  # [T, k]
    if not bool(lost.any()):
        return routing
    order = preference_order(routing.probs).tolist()  # [T, E]
    avail = available.tolist()
    moved = torch.zeros(experts.shape[0], dtype=torch.int64)
    for t, slot in torch.nonzero(lost).tolist():
        taken = set(experts[t].tolist())
        pick = next((e for e in order[t] if avail[e] and e not in taken), DROPPED)
        experts[t, slot] = pick
        moved[t] += 1
    weights = torch.gather(routing.probs, 1, experts.clamp(min=0))
    weights = torch.where(experts == DROPPED, torch.zeros_like(weights), weights)
    total = routing.weights.sum(-1, keepdim=True)  # keep each token's gate mass as it was
    weights = weights * total / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
    return Routing(experts=experts, weights=weights, rerouted=routing.rerouted,
                   dropped=int((experts == DROPPED).sum()), rerouted_per_token=routing.rerouted_per_token,
                   probs=routing.probs, degraded_per_token=moved)


def _fill_with_capacity(order: torch.Tensor, top_k: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> experts [T, k] (DROPPED where nothing had room), rerouted slots per token [T]."""
    num_tokens, num_experts = order.shape
    prefs = order.tolist()
    load = [0] * num_experts
    chosen: list[list[int]] = [[] for _ in range(num_tokens)]
    for _rank in range(top_k):
        for t in range(num_tokens):
            taken = chosen[t]
            pick = DROPPED
            for e in prefs[t]:
                if e not in taken and load[e] < capacity:
                    pick = e
                    break
            if pick != DROPPED:
                load[pick] += 1
            taken.append(pick)
    # A slot is rerouted when its expert is outside the token's uncapped top-k.
    rerouted = [sum(e != DROPPED and e not in prefs[t][:top_k] for e in chosen[t]) for t in range(num_tokens)]
    experts = torch.tensor(chosen, dtype=torch.int64).reshape(num_tokens, top_k)
    return experts, torch.tensor(rerouted, dtype=torch.int64)


def concat_routings(parts: list[Routing]) -> Routing:
    """The routings of consecutive token ranges (e.g. the micro-batches of one step) as one Routing over all their
    tokens, in the order given. Per-token tensors are concatenated, counters summed; an optional per-token field
    missing from some part is None (probs, rerouted_per_token) or zeros for those tokens (degraded_per_token)."""
    assert parts, "concat_routings needs at least one routing"
    if len(parts) == 1:
        return parts[0]

    def cat_or_none(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else torch.cat(values)

    degraded = None
    if any(p.degraded_per_token is not None for p in parts):
        degraded = torch.cat([p.degraded_per_token if p.degraded_per_token is not None
                              else torch.zeros(p.num_tokens, dtype=torch.int64) for p in parts])
    return Routing(
        experts=torch.cat([p.experts for p in parts]),  # [T, k]
        weights=torch.cat([p.weights for p in parts]),  # [T, k]
        rerouted=sum(p.rerouted for p in parts),
        dropped=sum(p.dropped for p in parts),
        rerouted_per_token=cat_or_none("rerouted_per_token"),  # [T]
        probs=cat_or_none("probs"),  # [T, E]
        degraded_per_token=degraded,  # [T]
    )
