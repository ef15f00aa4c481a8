"""The routed rows of one MoE layer, in the order both the router and the in-process reference use: pure torch.

  sort_rows     routing [T, k] -> every (token, slot) pair that has an expert, sorted by expert id (one stable sort),
                with the experts hit and their row counts
  combine_rows  expert outputs of those rows -> sum over each token's slots of gate weight * output, [T, H]
  slot_ranks    where each slot comes in its token's sum

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
    k = experts.shape[1]
    # One stable sort of all T*k positions (p = token * k + slot): rows of one expert keep (token, slot) order, as
    # nonzero(experts == e) gave them; dropped slots (-1) sort first and are cut off.
    ids_sorted, order = torch.sort(experts.reshape(-1), stable=True)  # [T*k], [T*k]
    hit, counts = torch.unique_consecutive(ids_sorted, return_counts=True)
    hit, counts = hit.tolist(), counts.tolist()
    if hit and hit[0] < 0:
        order = order[counts[0]:]  # [N]
        hit, counts = hit[1:], counts[1:]
    return SortedRows(tokens=order // k, slots=order % k, experts=hit, counts=counts)


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
    outputs: [N, H] the experts' unweighted outputs for those rows. The rows are grouped by rank (one stable sort);
    rank by rank, each group - at most one row per token - is weighted and added into the result (from zeros, as
    main's index_add_ per expert did). k small passes, each over at most [T, H]: no [N, H] temporaries, so the
    combine stays in cache and does not page-fault fresh buffers in.
    """
    num_tokens, k = routing.experts.shape
    result = torch.zeros_like(hidden)  # [T, H]
    if tokens.numel() == 0:
        return result
    ranks = slot_ranks(routing.experts)[tokens, slots]  # [N]
    by_rank = torch.sort(ranks, stable=True).indices  # [N]
    weights = routing.weights[tokens, slots]  # [N]
    for rows in by_rank.split(torch.bincount(ranks, minlength=k).tolist()):
        if rows.numel():
            weighted = outputs.index_select(0, rows) * weights[rows, None]  # [n_r, H]
            result.index_add_(0, tokens[rows], weighted.to(hidden.dtype))
    return result
