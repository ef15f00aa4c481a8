"""Top-k gating: softmax over the router logits, top-k with deterministic tie-breaking, optional renormalisation,
and an optional per-expert capacity that moves overflow to each token's next-best expert with room.

Several routers, one `Routing`: `route` (softmax; Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE), `route_topk_softmax` (gpt-oss:
top-k on the logits, softmax over the k), `route_deepseek_v2` (softmax, greedy or group-limited top-k, scaled
weights) and `route_sigmoid_grouped` (DeepSeek-V3, GLM-4.5: sigmoid scores, a correction bias that only ranks,
group-limited top-k, optional renormalisation, scaled weights), `route_softmax_biased` (ERNIE 4.5) and
`route_sigmoid_input` (Llama 4: the sigmoid score scales the expert's input), `route_softmax_scaled` (LongCat-Flash:
softmax over real and identity experts, biased selection, scaled, not renormalised; `split_identity` takes the
identity slots out for the decoder). `route_for_model` picks one
from the model config. Every router fills `Routing.probs` with a distribution over the E experts (softmax, or the
sigmoid scores normalised to sum 1) so that load statistics (routing entropy) and `degrade` work with each.

Pure torch; no Ray. The router and the in-process reference share it, so they route identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

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
    # [T, E] float32 what the router ranked experts by where that is not `probs` (sigmoid_grouped: score + correction
    # bias, experts outside the token's chosen groups at -inf); None = probs. `degrade` ranks replacements by it.
    selection: torch.Tensor | None = None
    shed_per_token: torch.Tensor | None = None  # [T] int64 slots moved off an overloaded expert (shedding)
    # [T, k] float32 Llama 4 (`route_sigmoid_input`): each slot's score multiplies the expert's *input*, and its
    # combine weight is 1; the decoder scales the hidden states before the expert round. None = no input scale.
    input_scales: torch.Tensor | None = None
    # [T] int64 LongCat-Flash: slots that chose an identity (zero-compute) expert, served by the decoder, not an
    # actor (`split_identity`); they are DROPPED in `experts` but are not drops: counted here, not in `dropped`.
    identity_per_token: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.experts.device

    @property
    def degraded(self) -> int:
        return 0 if self.degraded_per_token is None else int(self.degraded_per_token.sum())

    @property
    def identity(self) -> int:
        return 0 if self.identity_per_token is None else int(self.identity_per_token.sum())

    @property
    def shed(self) -> int:
        return 0 if self.shed_per_token is None else int(self.shed_per_token.sum())

    @property
    def num_tokens(self) -> int:
        return self.experts.shape[0]

    def tokens_per_expert(self, num_experts: int) -> torch.Tensor:
        """[E] int64: how many (token, slot) assignments each expert received, on the routing's device."""
        # A scatter into E + 1 bins (dropped slots in bin 0) instead of masking: a boolean mask and bincount both
        # read the device (a nonzero count, a max) on a GPU.
        ids = (self.experts + 1).reshape(-1)  # [T*k]
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
        return counts.scatter_add_(0, ids, torch.ones_like(ids))[1:]


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
    logits = router_logits.float()  # [T, E]
    experts, rerouted, dropped, rerouted_per_token = _choose(logits, top_k, capacity_factor)  # [T, k]
    chosen = torch.gather(logits, 1, experts.clamp(min=0))  # [T, k]
    chosen = chosen.masked_fill(experts == DROPPED, float("-inf"))
    weights = torch.softmax(chosen, dim=-1)  # [T, k]
    weights = torch.nan_to_num(weights, nan=0.0)  # a token with every slot dropped: all weights 0
    return Routing(experts=experts, weights=weights, rerouted=rerouted, dropped=dropped,
                   rerouted_per_token=rerouted_per_token, probs=torch.softmax(logits, dim=-1))


def route_deepseek_v2(
    router_logits: torch.Tensor,
    top_k: int,
    topk_method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    capacity_factor: float | None = None,
) -> Routing:
    """DeepSeek-V2's router (transformers' DeepseekV2TopkRouter). router_logits: [T, E] (computed in float32).

    Softmax over all experts; "greedy" takes the top-k, "group_limited_greedy" first keeps each token's best
    `topk_group` of `n_group` equal groups (a group scores its best expert) and takes the top-k inside them. Weights
    are the softmax probabilities times `routed_scaling_factor`, never renormalised (as in transformers).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    selection = None
    if topk_method == "group_limited_greedy":
        group_scores = probs.view(probs.shape[0], n_group, -1).max(dim=-1).values  # [T, G]
        keep = _group_mask(group_scores, topk_group, probs.shape[1])  # [T, E]
        selection = probs.masked_fill(~keep, 0.0)  # transformers fills 0, which every softmax prob beats
    elif topk_method != "greedy":
        raise ValueError(f"topk_method must be 'greedy' or 'group_limited_greedy', got {topk_method!r}")
    ranking = probs if selection is None else selection
    experts, rerouted, dropped, rerouted_per_token = _choose(ranking, top_k, capacity_factor)
    weights = _gathered(probs, experts) * routed_scaling_factor  # [T, k]
    return Routing(experts=experts, weights=weights, rerouted=rerouted, dropped=dropped,
                   rerouted_per_token=rerouted_per_token, probs=probs, selection=selection)


def route_sigmoid_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    capacity_factor: float | None = None,
) -> Routing:
    """DeepSeek-V3 / GLM-4.5's router (transformers' DeepseekV3TopkRouter). router_logits: [T, E] (float32).

    scores = sigmoid(logits); experts are *ranked* by scores + correction_bias ([E], `e_score_correction_bias`) but
    *weighted* by the scores alone. Group-limited: a group scores the sum of its two best ranked experts, each token
    keeps its best `topk_group` of `n_group` groups, the top-k comes from those. Weights: the chosen scores, divided
    by their sum when norm_topk_prob, times routed_scaling_factor. `probs` = scores / sum(scores) over all E experts.
    """
    scores = torch.sigmoid(router_logits.float())  # [T, E]
    num_tokens, num_experts = scores.shape
    choice = scores if correction_bias is None else scores + correction_bias.float()  # [T, E]
    group_scores = choice.view(num_tokens, n_group, -1).topk(min(2, num_experts // n_group), dim=-1).values.sum(-1)
    keep = _group_mask(group_scores, topk_group, num_experts)  # [T, E]
    selection = choice.masked_fill(~keep, float("-inf"))  # [T, E]
    experts, rerouted, dropped, rerouted_per_token = _choose(selection, top_k, capacity_factor)
    weights = _gathered(scores, experts)  # [T, k]
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    probs = scores / scores.sum(dim=-1, keepdim=True)  # [T, E] the sigmoid scores as a distribution
    return Routing(experts=experts, weights=weights, rerouted=rerouted, dropped=dropped,
                   rerouted_per_token=rerouted_per_token, probs=probs, selection=selection)


def route_softmax_biased(
    router_logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor | None = None,
    norm_min: float = 0.0,
    capacity_factor: float | None = None,
) -> Routing:
    """ERNIE 4.5 MoE's router (transformers' Ernie4_5_MoeTopKRouter). router_logits: [T, E] (float32).

    probs = softmax over all E experts; experts are *ranked* by probs + correction_bias ([E],
    `moe_statics.e_score_correction_bias`) but *weighted* by probs alone, divided by max(sum of the chosen probs,
    norm_min). `selection` (probs + bias) is what degraded re-routing ranks by.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    selection = probs if correction_bias is None else probs + correction_bias.float()  # [T, E]
    experts, rerouted, dropped, rerouted_per_token = _choose(selection, top_k, capacity_factor)  # [T, k]
    weights = _gathered(probs, experts)  # [T, k]
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=norm_min)
    weights = torch.nan_to_num(weights, nan=0.0)  # every slot dropped with norm_min 0: 0/0
    return Routing(experts=experts, weights=weights, rerouted=rerouted, dropped=dropped,
                   rerouted_per_token=rerouted_per_token, probs=probs, selection=selection)


def route_sigmoid_input(
    router_logits: torch.Tensor, top_k: int = 1, capacity_factor: float | None = None
) -> Routing:
    """Llama 4's router (transformers' Llama4Router + Llama4TextMoe). router_logits: [T, E] in the model dtype.

    Experts: the top-k of the logits (ties: lower id). Score: sigmoid of the chosen logit in float32, rounded to the
    logits' dtype as transformers holds it; it scales the expert's *input* (`input_scales`), and the expert's output
    is added with weight 1 (`weights`; 0 for a dropped slot). `probs`: the sigmoid scores over all E normalised to
    sum 1 (load statistics, degraded re-routing, which ranks by them, the same order as the logits).
    """
    logits = router_logits.float()  # [T, E]
    experts, rerouted, dropped, rerouted_per_token = _choose(logits, top_k, capacity_factor)  # [T, k]
    scores = torch.sigmoid(logits)  # [T, E]
    chosen = torch.sigmoid(_gathered(logits, experts)).to(router_logits.dtype).float()  # [T, k]
    chosen = torch.where(experts == DROPPED, torch.zeros_like(chosen), chosen)
    weights = (experts != DROPPED).float()  # [T, k]
    probs = scores / scores.sum(dim=-1, keepdim=True)  # [T, E]
    return Routing(experts=experts, weights=weights, rerouted=rerouted, dropped=dropped,
                   rerouted_per_token=rerouted_per_token, probs=probs, input_scales=chosen)


def route_softmax_scaled(
    router_logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    capacity_factor: float | None = None,
) -> Routing:
    """LongCat-Flash's router (transformers' LongcatFlashTopkRouter). router_logits: [T, E + Z] float32 over the
    real experts then the zero-compute (identity) ones.

    probs = softmax over all E + Z; experts *ranked* by probs + correction_bias ([E + Z], `e_score_correction_bias`),
    *weighted* by probs alone x routed_scaling_factor, never renormalised. Ties: the lower id first (transformers'
    topk is unsorted; the set is the same, the slot order may differ). Ids >= E are identity experts: see
    `split_identity`.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E + Z]
    selection = probs if correction_bias is None else probs + correction_bias.float()  # [T, E + Z]
    experts, rerouted, dropped, rerouted_per_token = _choose(selection, top_k, capacity_factor)  # [T, k]
    weights = _gathered(probs, experts) * routed_scaling_factor  # [T, k]
    return Routing(experts=experts, weights=weights, rerouted=rerouted, dropped=dropped,
                   rerouted_per_token=rerouted_per_token, probs=probs, selection=selection)


def split_identity(routing: Routing, num_experts: int) -> tuple[Routing, torch.Tensor]:
    """A routing over E real experts and identity experts (ids >= num_experts, LongCat-Flash's zero-compute experts)
    -> (the routing the expert backend serves: identity slots DROPPED with weight 0, probs / selection cut to the E
    real experts, `identity_per_token` [T] counting the identity slots; identity_weight [T] float32: the summed
    weight of each token's identity slots, so their output is identity_weight x hidden). No device read."""
    identity = routing.experts >= num_experts  # [T, k]
    served = replace(
        routing,
        experts=torch.where(identity, torch.full_like(routing.experts, DROPPED), routing.experts),  # [T, k]
        weights=torch.where(identity, torch.zeros_like(routing.weights), routing.weights),  # [T, k]
        probs=None if routing.probs is None else routing.probs[:, :num_experts],  # [T, E]
        selection=None if routing.selection is None else routing.selection[:, :num_experts],  # [T, E]
        identity_per_token=identity.sum(dim=-1),  # [T]
    )
    identity_weight = torch.where(identity, routing.weights, torch.zeros_like(routing.weights)).sum(dim=-1)  # [T]
    return served, identity_weight


def route_for_model(
    cfg, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None,
    capacity_factor: float | None = None,
) -> Routing:
    """The router of `cfg` (an experts.config.MoEModelConfig) over router_logits [T, E]."""
    if cfg.router_kind == "softmax":
        return route(router_logits, cfg.top_k, cfg.norm_topk_prob, capacity_factor)
    if cfg.router_kind == "deepseek_v2":
        return route_deepseek_v2(router_logits, cfg.top_k, cfg.topk_method, cfg.n_group, cfg.topk_group,
                                 cfg.routed_scaling_factor, capacity_factor)
    if cfg.router_kind == "topk_softmax":  # gpt-oss
        return route_topk_softmax(router_logits, cfg.top_k, capacity_factor)
    if cfg.router_kind == "sigmoid_grouped":
        return route_sigmoid_grouped(router_logits, cfg.top_k, correction_bias, cfg.n_group, cfg.topk_group,
                                     cfg.norm_topk_prob, cfg.routed_scaling_factor, capacity_factor)
    if cfg.router_kind == "softmax_biased":  # ERNIE 4.5
        return route_softmax_biased(router_logits, cfg.top_k, correction_bias, cfg.router_norm_min, capacity_factor)
    if cfg.router_kind == "sigmoid_input":  # Llama 4
        return route_sigmoid_input(router_logits, cfg.top_k, capacity_factor)
    if cfg.router_kind == "softmax_scaled":  # LongCat-Flash
        return route_softmax_scaled(router_logits, cfg.top_k, correction_bias, cfg.routed_scaling_factor,
                                    capacity_factor)
    raise ValueError(f"router_kind={cfg.router_kind!r} is not a known router")


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """group_scores [T, G] -> [T, E] bool: the experts of each token's best topk_group groups (ties: lower id)."""
    num_tokens, num_groups = group_scores.shape
    best = preference_order(group_scores)[:, :topk_group]  # [T, g]
    chosen = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=group_scores.device)
    chosen.scatter_(1, best, True)  # [T, G]
    return chosen[:, :, None].expand(-1, -1, num_experts // num_groups).reshape(num_tokens, num_experts)


def _choose(
    ranking: torch.Tensor, top_k: int, capacity_factor: float | None
) -> tuple[torch.Tensor, int, int, torch.Tensor | None]:
    """ranking [T, E] -> (experts [T, k], rerouted, dropped, rerouted_per_token): the top-k by ranking, or with a
    capacity the same rank-by-rank fill as `route` (overflow goes to the next-ranked expert with room)."""
    num_tokens, num_experts = ranking.shape
    assert 0 < top_k <= num_experts, f"top_k={top_k} must be in 1..{num_experts}"
    order = preference_order(ranking)  # [T, E]
    if capacity_factor is None:
        return order[:, :top_k].contiguous(), 0, 0, None
    if not (capacity_factor > 0 and math.isfinite(capacity_factor)):
        raise ValueError(f"capacity_factor must be a positive finite number, got {capacity_factor}")
    capacity = max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))
    experts, rerouted_per_token = _fill_with_capacity(order, top_k, capacity)
    return experts, int(rerouted_per_token.sum()), int((experts == DROPPED).sum()), rerouted_per_token


def _gathered(values: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """values [T, E] at experts [T, k]; 0 for dropped slots."""
    picked = torch.gather(values, 1, experts.clamp(min=0))  # [T, k]
    return torch.where(experts == DROPPED, torch.zeros_like(picked), picked)


def degrade(routing: Routing, available: torch.Tensor) -> Routing:
    """Move every slot whose expert is unavailable to the token's next-best available expert it does not already
    use; the token's weights are then rescaled to their original total. available: [E] bool.

    Used when no replica of a shard is alive and the operator chose to degrade rather than wait. A slot with no
    available expert left is dropped (weight 0).

    "Gate weight" is the router's own probability of an expert (`probs`): the softmax for `route` and
    `route_deepseek_v2`; for the sigmoid router, the expert's sigmoid score over the sum of all E scores. Rescaled
    to the token's original total, a sigmoid-routed token with norm_topk_prob therefore gets exactly the weights the
    router would give its new expert set (score / sum of the chosen scores x routed_scaling_factor); without it the
    token keeps its routed mass, split in proportion to the sigmoid scores. Replacements are ranked by what the
    router ranked by (`selection`: score + correction bias, the token's chosen groups first), else by `probs`.
    """
    available = available.to(routing.experts.device)  # [E]; the router degrades host routings (a no-op copy)
    lost = (routing.experts >= 0) & ~available[routing.experts.clamp(min=0)]  # [T, k]
    if not bool(lost.any()):
        return routing
    return move_slots(routing, lost, available, "degraded")


def move_slots(routing: Routing, move: torch.Tensor, available: torch.Tensor, reason: str) -> Routing:
    """Send the slots in `move` ([T, k] bool) to each token's next-best expert that is `available` ([E] bool) and
    not already one of the token's experts, as `degrade` describes (weights from `probs`, rescaled to the token's
    original total). No candidate left: a degraded slot is dropped, a shed slot stays where it was. reason
    "degraded" (no live replica) or "shed" (overload shedding) names the per-token counter the moves are added to."""
    assert routing.probs is not None, "moving slots needs the gate probabilities"
    assert reason in ("degraded", "shed"), f"unknown reason {reason!r}"
    ranking = routing.probs if routing.selection is None else routing.selection
    move = move.to(routing.experts.device)  # [T, k]
    rows = torch.nonzero(move.any(dim=1)).flatten()  # [R] tokens with a slot to move (shedding moves few)
    order = preference_order(ranking[rows]).tolist()  # [R, E]
    chosen = routing.experts[rows].tolist()  # [R, k], edited in place
    avail = available.tolist()
    moved_rows = [0] * len(chosen)
    # Plain lists: a Python step per moved slot, no tensor op per slot.
    for i, (row, wanted) in enumerate(zip(chosen, move[rows].tolist())):
        for slot, go in enumerate(wanted):
            if not go:
                continue
            pick = next((e for e in order[i] if avail[e] and e not in row), DROPPED)
            if pick == DROPPED and reason == "shed":
                continue  # shedding protects latency; it never drops a slot that has nowhere else to go
            row[slot] = pick
            moved_rows[i] += 1
    device = routing.experts.device
    experts = routing.experts.clone()  # [T, k]
    moved = torch.zeros(experts.shape[0], dtype=torch.int64, device=device)  # [T]
    if len(chosen):
        experts[rows] = torch.tensor(chosen, dtype=torch.int64, device=device)
        moved[rows] = torch.tensor(moved_rows, dtype=torch.int64, device=device)
    weights = torch.gather(routing.probs, 1, experts.clamp(min=0))
    weights = torch.where(experts == DROPPED, torch.zeros_like(weights), weights)
    total = routing.weights.sum(-1, keepdim=True)  # keep each token's gate mass as it was
    weights = weights * total / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
    # Only the tokens that moved change: the others keep their weights bit for bit.
    weights = torch.where((moved > 0)[:, None], weights, routing.weights)
    counters = {"degraded_per_token": routing.degraded_per_token, "shed_per_token": routing.shed_per_token}
    key = f"{reason}_per_token"
    counters[key] = moved if counters[key] is None else counters[key] + moved
    # identity slots (LongCat) are DROPPED in `experts` but were never moved and are not drops
    return Routing(experts=experts, weights=weights, rerouted=routing.rerouted,
                   dropped=int((experts == DROPPED).sum()) - routing.identity,
                   rerouted_per_token=routing.rerouted_per_token, probs=routing.probs, selection=routing.selection,
                   input_scales=routing.input_scales, identity_per_token=routing.identity_per_token, **counters)


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
    experts = torch.tensor(chosen, dtype=torch.int64, device=order.device).reshape(num_tokens, top_k)
    return experts, torch.tensor(rerouted, dtype=torch.int64, device=order.device)


def concat_routings(parts: list[Routing]) -> Routing:
    """The routings of consecutive token ranges (e.g. the micro-batches of one step) as one Routing over all their
    tokens, in the order given. Per-token tensors are concatenated, counters summed; an optional per-token field
    missing from some part is None (probs, rerouted_per_token) or zeros for those tokens (degraded_per_token,
    shed_per_token)."""
    assert parts, "concat_routings needs at least one routing"
    if len(parts) == 1:
        return parts[0]

    def cat_or_none(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else torch.cat(values)

    def cat_or_zeros(name: str) -> torch.Tensor | None:
        if all(getattr(p, name) is None for p in parts):
            return None
        return torch.cat([getattr(p, name) if getattr(p, name) is not None
                          else torch.zeros(p.num_tokens, dtype=torch.int64, device=p.device) for p in parts])

    return Routing(
        experts=torch.cat([p.experts for p in parts]),  # [T, k]
        weights=torch.cat([p.weights for p in parts]),  # [T, k]
        rerouted=sum(p.rerouted for p in parts),
        dropped=sum(p.dropped for p in parts),
        rerouted_per_token=cat_or_none("rerouted_per_token"),  # [T]
        probs=cat_or_none("probs"),  # [T, E]
        degraded_per_token=cat_or_zeros("degraded_per_token"),  # [T]
        shed_per_token=cat_or_zeros("shed_per_token"),  # [T]
        identity_per_token=cat_or_zeros("identity_per_token"),  # [T]
        selection=cat_or_none("selection"),  # [T, E]
        input_scales=cat_or_none("input_scales"),  # [T, k]
    )
