"""The routed rows of one MoE layer, in the order both the router and the in-process reference use: pure torch.

  sort_rows     routing [T, k] -> every (token, slot) pair that has an expert, sorted by expert id (one stable sort),
                with the experts hit and their row counts
  combine_pieces  expert outputs, as pieces of one expert's rows each -> sum over each token's slots of
                  gate weight * output, [T, H]: one index_add_ per piece in ascending expert order while pieces are
                  few, else `combine_rows`
  combine_rows    the same for rows in any order: k passes, one per place in the tokens' sums (`slot_ranks`)

Both the distributed combine (router_service/dispatch_plan.py) and LocalExperts call `combine_pieces`, so the
floating-point sum of a token's expert outputs is taken in one fixed order - the token's experts by ascending id, a
repeated expert in slot order - whichever replicas computed the rows and in whatever order the calls came back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .device_rule import cat_to_device, to_device
from .gating import Routing

# Up to this many pieces, one index_add_ per piece (no copies: the pieces' outputs are views) beats the rank passes,
# which pay a fixed ~20 small ops and one gather of every row (measured at 8 experts / top-2: the many-expert path
# was ~0.2 ms slower per layer than main's loop). Both add each token's outputs in the same order, so the same bits.
PIECE_LOOP_MAX = 16


@dataclass(frozen=True)
class Piece:
    """Rows of one expert: its outputs for (token, slot) pairs, in (token, slot) order."""

    expert: int
    tokens: torch.Tensor  # [n]
    slots: torch.Tensor  # [n]
    outputs: torch.Tensor  # [n, H] unweighted


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
    ranks.scatter_(1, order, torch.arange(k, dtype=order.dtype, device=order.device).expand(num_tokens, k))  # [T, k]
    return ranks


def combine_rows(hidden: torch.Tensor, routing: Routing, tokens: torch.Tensor, slots: torch.Tensor,
                 outputs: torch.Tensor) -> torch.Tensor:
    """sum over slots of weight * expert output, in the fixed order of `slot_ranks`.

    hidden: [T, H] (shape, dtype and device of the result); tokens, slots: [N] the rows' (token, slot), in any
    order, on the routing's device; outputs: [N, H] the experts' unweighted outputs for those rows. The rows are
    grouped by rank (one stable sort); rank by rank, each group - at most one row per token - is weighted and added
    into the result (from zeros, as main's index_add_ per expert did). k small passes, each over at most [T, H]:
    no [N, H] temporaries, so the combine stays in cache and does not page-fault fresh buffers in.
    The router passes a host routing and host outputs (experts/device_rule.py): the grouping is host bookkeeping and
    only the arithmetic runs on hidden's device.
    """
    k = routing.experts.shape[1]
    if tokens.numel() == 0:
        return torch.zeros_like(hidden)
    ranks = slot_ranks(routing.experts)[tokens, slots]  # [N]
    by_rank = torch.sort(ranks, stable=True).indices  # [N]
    weights = routing.weights[tokens, slots]  # [N]
    sizes = torch.bincount(ranks, minlength=k).tolist()  # a device read only for a device routing (the reference)
    # A generator: on one device each rank's rows are gathered just before they are added (no [N, H] temporaries);
    # rows on the host are gathered once and sent up together by _accumulate.
    groups = ((tokens[rows], weights[rows], outputs.index_select(0, _index_on(rows, outputs.device)))
              for rows in by_rank.split(sizes) if rows.numel())
    return _accumulate(hidden, groups, same_device=_all_on(hidden.device, tokens, weights, outputs))


def combine_pieces(hidden: torch.Tensor, routing: Routing, pieces: Sequence[Piece]) -> torch.Tensor:
    """sum over slots of weight * expert output, each token's outputs in ascending expert order (a repeated expert
    in slot order): the one combine of the router and the reference. hidden: [T, H] (shape, dtype, device); the
    pieces' tokens and slots on the routing's device."""
    if len(pieces) > PIECE_LOOP_MAX:
        return combine_rows(hidden, routing, torch.cat([p.tokens for p in pieces]),
                            torch.cat([p.slots for p in pieces]), torch.cat([p.outputs for p in pieces]))
    # Ascending expert; one expert's replica chunks by their first row (chunks are contiguous in (token, slot)).
    # The keys are host reads only when the pieces' indices are on a device (the reference on a GPU).
    ordered = sorted((p for p in pieces if p.tokens.numel()),
                     key=lambda p: (p.expert, int(p.tokens[0]), int(p.slots[0])))
    groups = [(p.tokens, routing.weights[p.tokens, p.slots], p.outputs) for p in ordered]
    return _accumulate(hidden, groups, same_device=all(_all_on(hidden.device, *g) for g in groups))


def _index_on(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index for device outputs goes up without a wait (a pageable copy would wait for the stream)."""
    return to_device(index, device) if index.device.type == "cpu" else index.to(device)


def _all_on(device: torch.device, *tensors: torch.Tensor) -> bool:
    return all(t.device == device for t in tensors)


def _accumulate(hidden: torch.Tensor, groups: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                same_device: bool) -> torch.Tensor:
    """zeros [T, H] on hidden's device + each group's weight * output, in the order given. groups: (tokens [n],
    weights [n], outputs [n, H]), all on hidden's device when same_device. Groups held on the host (the router's)
    go to the device in one batch of non-blocking copies; the products and sums are the same operations wherever
    the rows came from, so the same bits."""
    result = torch.zeros_like(hidden)  # [T, H]
    device = hidden.device
    if not same_device:
        groups = list(groups)
        sizes = [t.numel() for t, _, _ in groups]
        tokens = cat_to_device([t.cpu() for t, _, _ in groups], device).split(sizes)
        weights = cat_to_device([w.cpu() for _, w, _ in groups], device).split(sizes)
        ys = [y for _, _, y in groups]
        # Outputs a device-to-device transport read onto the device stay there; host ones go up with the indices.
        outputs = (torch.cat(ys) if ys and all(y.device == device for y in ys)
                   else cat_to_device([y.cpu() for y in ys], device)).split(sizes)
        groups = list(zip(tokens, weights, outputs))
    for tokens, weights, outputs in groups:
        weighted = outputs * weights[:, None]  # [n, H]
        result.index_add_(0, tokens, weighted.to(hidden.dtype))
    return result

