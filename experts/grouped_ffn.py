"""All of a call's experts in two grouped matmuls, not a Python loop per expert: the actors and the in-process
reference both compute experts through `GroupedExperts.run`, so they use one formulation.

A host's experts are stacked per layer ([E_local, 2I, H] and [E_local, H, I]); the shards' weights become views of
the stacks, so stacking costs no extra memory. A call's rows arrive grouped by expert; `torch._grouped_mm` takes the
whole stack with each expert's row count (zero for the experts the call does not use), so no weight is copied per
call.

Why `_grouped_mm` (ops/bench/grouped_ffn.py, docs/benchmarks/results/bench/many_experts/grouped_ffn.json): on
this CPU it beat
the per-expert loop in 7 of 8 cases from 8 to 256 experts (up to 3.7x at 64 tokens; the loop pays ~20 us of Python
and dispatch per expert), and it is bit-identical to it: each group is an ordinary matmul of that expert's rows, so
an expert's rows give the same bits whichever other experts share the call (tests/unit/test_grouped_ffn.py checks
both). bmm over padded groups was 1.2-4.4x slower than the loop and not bit-identical (its rows are padded to the
largest group). Where `_grouped_mm` does not run (an older torch, a device/dtype it rejects) the same function falls
back to the loop; on CPU that gives the same bits.

The gate activation is `ffn.gated_activation` (row blocks below torch's parallel grain), so a row's activation takes
the same code path whatever shares the call and however many threads run.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch
import torch.nn.functional as F

from . import reproducible
from .ffn import GatedMLPWeights, gated_activation, gated_mlp
from .reproducible import MIN_ROWS

Shard = tuple[int, int]  # (layer, expert)
_grouped_mm_ok: dict[tuple[str, torch.dtype], bool] = {}


class LayerStack:
    """One layer's experts of one host, stacked in ascending expert id."""

    def __init__(self, experts: list[int], gate_up: torch.Tensor, down: torch.Tensor):
        self.experts = experts
        self.gate_up = gate_up  # [E_local, 2I, H]
        self.down = down  # [E_local, H, I]
        self.local = {e: i for i, e in enumerate(experts)}

    def weights(self, expert: int) -> GatedMLPWeights:
        i = self.local[expert]
        return GatedMLPWeights(self.gate_up[i], self.down[i])


class GroupedExperts:
    """The experts a host holds, computed call by call with grouped matmuls.

    shards: (layer, expert) -> weights; their entries are replaced by views of the per-layer stacks."""

    def __init__(self, shards: dict[Shard, GatedMLPWeights], act: Callable[[torch.Tensor], torch.Tensor]):
        self.act = act
        self.layers: dict[int, LayerStack] = {}
        # gpt-oss's experts (biases, clamped SwiGLU) are not the plain gated MLP the grouped kernels compute, and
        # quantised experts (experts/quant.py) have no grouped kernel: those run one matmul pair per expert (the
        # same function the reference uses, so the bits still agree).
        self.shards = shards
        self.grouped = all(w.kind == "gated" and w.gate_up_bias is None and w.down_bias is None
                           and w.quant == "none" for w in shards.values())
        for layer in sorted({layer for layer, _ in shards}) if self.grouped else ():
            experts = sorted(e for lyr, e in shards if lyr == layer)
            gate_up = torch.stack([shards[(layer, e)].gate_up for e in experts])  # [E_local, 2I, H]
            down = torch.stack([shards[(layer, e)].down for e in experts])  # [E_local, H, I]
            for i, e in enumerate(experts):
                shards[(layer, e)] = GatedMLPWeights(gate_up[i], down[i])
            self.layers[layer] = LayerStack(experts, gate_up, down)

    def run(self, layer: int, experts: list[int], counts: list[int], x: torch.Tensor) -> torch.Tensor:
        """x: [sum(counts), H], rows grouped by expert in `experts` order -> unweighted outputs, same layout."""
        if not self.grouped:
            outs = [gated_mlp(rows, self.shards[(layer, e)], self.act) for e, rows in zip(experts, x.split(counts))]
            return torch.cat(outs) if outs else x.new_zeros((0, x.shape[1]))
        stack = self.layers[layer]
        if list(experts) != sorted(set(experts)):
            # Not ascending (or an expert twice): compute in ascending order, then put the rows back.
            ids = torch.repeat_interleave(torch.tensor(experts), torch.tensor(counts))  # [N]
            order = torch.sort(ids, stable=True).indices  # [N]
            hit, per = torch.unique_consecutive(ids[order], return_counts=True)
            out = torch.empty_like(x)
            out[order] = self.run(layer, hit.tolist(), per.tolist(), x[order])
            return out
        return grouped_gated_mlp(x, stack, experts, counts, self.act)


def grouped_gated_mlp(x: torch.Tensor, stack: LayerStack, experts: list[int], counts: list[int],
                      act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) per expert. x: [N, H] grouped by `experts` (ascending, each once) -> [N, H]."""
    if x.shape[0] == 0:
        return x.new_zeros((0, stack.down.shape[1]))
    keep = None  # with padded groups: [N] rows of the padded x that are the call's own
    if _grouped_mm_runs(x):
        per_expert = [0] * len(stack.experts)
        for e, n in zip(experts, counts):
            per_expert[stack.local[e]] = n
        if x.device.type in reproducible.CPU_KERNEL_DEVICES and any(0 < n < MIN_ROWS for n in per_expert):
            # Each group of at least MIN_ROWS rows (experts/reproducible.py): pad the short ones with zero rows.
            x, keep, per_expert = _pad_groups(x, per_expert)
        offsets = torch.tensor(per_expert, dtype=torch.int32, device=x.device).cumsum(0, dtype=torch.int32)
        try:
            h = torch._grouped_mm(x, stack.gate_up.transpose(1, 2), offs=offsets)  # [N', 2I]
            y = torch._grouped_mm(gated_activation(h, act), stack.down.transpose(1, 2), offs=offsets)  # [N', H]
            return y if keep is None else y[keep]  # [N, H]
        except RuntimeError:
            # A kernel with shape or alignment limits (CUDA's) refused these weights: loop from now on, in this
            # process, for this device and dtype.
            _grouped_mm_ok[(x.device.type, x.dtype)] = False
    if keep is not None:
        x = x[keep]  # the padded rows of the attempt above, dropped again
    outs = [gated_mlp(rows, stack.weights(e), act) for e, rows in zip(experts, x.split(counts))]  # [n_e, H] each
    return torch.cat(outs)


def _pad_groups(x: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """x: [N, H] in groups of `counts` rows -> (x with each non-empty group padded to MIN_ROWS rows by zero rows
    [N', H], the [N] indices of the original rows in it, the padded counts)."""
    padded = [max(n, MIN_ROWS) if n else 0 for n in counts]
    starts = accumulate(padded[:-1], initial=0)  # each group's first row in the padded tensor
    # Indices as Python ints, one tensor at the end: this runs for every decode-sized call of an actor.
    keep = torch.tensor([start + i for n, start in zip(counts, starts) for i in range(n)], dtype=torch.int64)  # [N]
    out = x.new_zeros((sum(padded), x.shape[1]))  # [N', H]
    out[keep] = x
    return out, keep.to(x.device), padded


def _grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm works for this device and dtype here (probed once)."""
    key = (x.device.type, x.dtype)
    if key not in _grouped_mm_ok:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.ones(2, 16, device=x.device, dtype=x.dtype)
                b = torch.ones(2, 16, 16, device=x.device, dtype=x.dtype)
                offs = torch.tensor([1, 2], dtype=torch.int32, device=x.device)
                expected = F.linear(a[:1], b[0].t())  # [1, 16]
                ok = bool(torch.equal(torch._grouped_mm(a, b, offs=offs)[:1], expected))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _grouped_mm_ok[key] = ok
    return _grouped_mm_ok[key]
