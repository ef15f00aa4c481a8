"""Which grouped formulation computes a call's experts fastest here, and which is bit-identical to one matmul per
expert: `expertmesh bench grouped-ffn` (or `python -m expertmesh.ops.bench.grouped_ffn [--out FILE]`) prints
JSON.

Candidates, on the same rows (a random top-k routing of T tokens, rows grouped by expert ascending):
  loop        one gated_mlp (two F.linear) per expert hit: main's actor and reference
  grouped_mm  two torch._grouped_mm over the layer's stacked weights with per-expert row counts
              (experts/grouped_ffn.py: what the actors and the reference use)
  bmm         rows padded to the largest group, two torch.bmm over the hit experts' weights
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...experts.ffn import GatedMLPWeights, activation, gated_mlp
from ...experts.grouped_ffn import GroupedExperts
from .common import best_ms, machine_info

CASES = ((8, 2, 64), (8, 2, 1024), (64, 8, 64), (64, 8, 1024), (128, 8, 64), (128, 8, 1024), (256, 8, 64),
         (256, 8, 1024))  # (experts, top-k, tokens)


def _bmm(x, counts, gate_up, down, hit, act):
    """Rows padded per expert to the largest group: [E_hit, M, H] @ [E_hit, H, 2I]."""
    counts_t = torch.tensor(counts)
    seg = torch.repeat_interleave(torch.arange(len(hit)), counts_t)  # [N]
    pos = torch.arange(x.shape[0]) - torch.repeat_interleave(counts_t.cumsum(0) - counts_t, counts_t)  # [N]
    padded = x.new_zeros(len(hit), max(counts), x.shape[1])
    padded[seg, pos] = x
    idx = torch.tensor(hit)
    h = torch.bmm(padded, gate_up[idx].transpose(1, 2))  # [E_hit, M, 2I]
    g, u = h.chunk(2, dim=-1)
    return torch.bmm(act(g) * u, down[idx].transpose(1, 2))[seg, pos]  # [N, H]


@dataclass(frozen=True)
class GroupedFFNParams:
    """hidden / inter: the experts' size; cases: (experts, top-k, tokens); threads: torch threads, as an expert
    actor given that many CPUs (on a shared machine more than the free cores measures the neighbours, not the
    kernels)."""

    hidden: int = 256
    inter: int = 96
    repeats: int = 7
    seed: int = 0
    threads: int = 1
    cases: tuple[tuple[int, int, int], ...] = CASES

    @classmethod
    def from_args(cls, args) -> GroupedFFNParams:
        return cls(hidden=args.hidden, inter=args.inter, repeats=args.repeats, threads=args.threads)


def run_grouped_ffn_bench(params: GroupedFFNParams = GroupedFFNParams()) -> dict:
    hidden, inter, repeats = params.hidden, params.inter, params.repeats
    torch.set_num_threads(params.threads)
    act = activation("silu")
    gen = torch.Generator().manual_seed(params.seed)
    out: dict = {"benchmark": "grouped_ffn", "hidden": hidden, "inter": inter, "repeats": repeats,
                 "machine": machine_info(torch_threads=torch.get_num_threads()), "cases": []}
    for experts, k, tokens in params.cases:
        shards = {(0, e): GatedMLPWeights.from_parts(torch.randn(inter, hidden, generator=gen) * 0.05,
                                                     torch.randn(inter, hidden, generator=gen) * 0.05,
                                                     torch.randn(hidden, inter, generator=gen) * 0.05)
                  for e in range(experts)}
        grouped = GroupedExperts(shards, act)
        stack = grouped.layers[0]
        ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :k].reshape(-1)
        per = torch.bincount(ids, minlength=experts)
        hit = [e for e in range(experts) if per[e] > 0]
        counts = [int(per[e]) for e in hit]
        x = torch.randn(sum(counts), hidden, generator=gen)

        def loop():
            return torch.cat([gated_mlp(r, shards[(0, e)], act) for e, r in zip(hit, x.split(counts))])  # noqa: B023

        want = loop()
        out["cases"].append({
            "experts": experts, "top_k": k, "tokens": tokens, "rows": int(x.shape[0]), "experts_hit": len(hit),
            "loop_ms": best_ms(loop, repeats),
            "grouped_mm_ms": best_ms(lambda: grouped.run(0, hit, counts, x), repeats),  # noqa: B023
            "bmm_ms": best_ms(lambda: _bmm(x, counts, stack.gate_up, stack.down, hit, act), repeats),  # noqa: B023
            "grouped_mm_bit_identical": bool(torch.equal(grouped.run(0, hit, counts, x), want)),
            "bmm_bit_identical": bool(torch.equal(_bmm(x, counts, stack.gate_up, stack.down, hit, act), want)),
        })
    return out


def main() -> None:
    """`python -m expertmesh.ops.bench.grouped_ffn [flags]`: the same as `expertmesh bench grouped-ffn [flags]`."""
    import sys

    from ..cli import main as cli_main

    sys.exit(cli_main(["bench", "grouped-ffn", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
