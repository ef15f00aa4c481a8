"""The routed rows of one MoE layer, in the order both the router and the in-process reference use: pure torch.

  sort_rows     routing [T, k] -> every (token, slot) pair that has an expert, sorted by expert id (one stable sort),
                with the experts hit and their row counts
  combine_rows  expert outputs of those rows -> sum over each token's slots of gate weight * output, [T, H]

Both the distributed combine (router_service/dispatch_plan.py) and LocalExperts call `combine_rows`, so the
floating-point sum of a token's expert outputs is taken in one fixed order - the token's experts by ascending id, a
repeated expert in slot order - whichever replicas computed the rows and in whatever order the calls came back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gating import Routing


@dataclass(frozen=True)
class SortedRows:
    """The (token, slot) pairs of a layer that have an expert, grouped by expert id ascending; within an expert in
    (token, slot) order. Dropped slots (expert -1) are left out."""

    tokens: torch.Tensor  # [N] int64 token positions
    slots: torch.Tensor  # [N] int64 which of the k slots
    experts: list[int]  # the experts hit, ascending
    counts: list[int]  # rows of each, aligned with `experts` (sum = N)


def sort_rows(experts: torch.Tensor) -> SortedRows:
    """experts: [T, k] int64 expert ids (-1 = dropped) -> the routed rows sorted by expert."""
    num_tokens, k = experts.shape
    flat = experts.reshape(-1)  # [T*k], position p = token * k + slot
    kept = torch.nonzero(flat >= 0).squeeze(1)  # [N] ascending positions
    ids = flat[kept]  # [N]
    # Stable: rows of one expert keep (token, slot) order, which is what nonzero(experts == e) gave per expert.
    ids_sorted, order = torch.sort(ids, stable=True)  # [N], [N]
    pos = kept[order]  # [N]
    hit, counts = torch.unique_consecutive(ids_sorted, return_counts=True)
    return SortedRows(tokens=pos // k, slots=pos % k, experts=hit.tolist(), counts=counts.tolist())


def slot_ranks(experts: torch.Tensor) -> torch.Tensor:
    """[T, k] expert ids -> [T, k] each slot's place in its token's summation order: experts ascending, a repeated
    expert in slot order, dropped slots last."""
    num_tokens, k = experts.shape
    key = torch.where(experts >= 0, experts, torch.iinfo(experts.dtype).max)  # [T, k]
    order = torch.sort(key, dim=1, stable=True).indices  # [T, k] slots in summation order
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(k, dtype=order.dtype).expand(num_tokens, k))  # [T, k]
    return ranks


def combine_rows(hidden: torch.Tensor, routing: Routing, tokens: torch.Tensor, slots: torch.Tensor,
                 outputs: torch.Tensor) -> torch.Tensor:
    """sum over slots of weight * expert output, in the fixed order of `slot_ranks`.

    hidden: [T, H] (shape and dtype of the result); tokens, slots: [N] the rows' (token, slot), in any order;
    outputs: [N, H] the experts' unweighted outputs for those rows. Each weighted row lands in a [k, T, H] buffer at
    its rank; the ranks are then added one after another (starting from zeros, as index_add_ into zeros did).
    """
    num_tokens, k = routing.experts.shape
    result = torch.zeros_like(hidden)  # [T, H]
    if tokens.numel() == 0:
        return result
    weighted = (outputs * routing.weights[tokens, slots, None]).to(hidden.dtype)  # [N, H]
    ranks = slot_ranks(routing.experts)[tokens, slots]  # [N]
    buffer = hidden.new_zeros((k, num_tokens, hidden.shape[1]))  # [k, T, H]
    buffer[ranks, tokens] = weighted
    # A slot without a row (dropped) adds +0.0, which leaves every partial sum as it was (they start at +0.0).
    for rank in range(int(ranks.max()) + 1):
        result.add_(buffer[rank])
    return result
