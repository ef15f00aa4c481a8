"""Which grouped formulation computes a call's experts fastest here, and which is bit-identical to one matmul per
expert: `python -m expertmesh.ops.bench.grouped_ffn [--out FILE]` prints JSON.

Candidates, on the same rows (a random top-k routing of T tokens, rows grouped by expert ascending):
  loop        one gated_mlp (two F.linear) per expert hit: main's actor and reference
  grouped_mm  two torch._grouped_mm over the layer's stacked weights with per-expert row counts
              (experts/grouped_ffn.py: what the actors and the reference use)
  bmm         rows padded to the largest group, two torch.bmm over the hit experts' weights
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from ...experts.ffn import GatedMLPWeights, activation, gated_mlp
from ...experts.grouped_ffn import GroupedExperts

CASES = [(8, 2, 64), (8, 2, 1024), (64, 8, 64), (64, 8, 1024), (128, 8, 64), (128, 8, 1024), (256, 8, 64),
         (256, 8, 1024)]  # (experts, top-k, tokens)


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


def _best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(1000 * min(times), 3)


def run(hidden: int = 256, inter: int = 96, repeats: int = 7, seed: int = 0, threads: int = 1) -> dict:
    """threads: torch threads, as an expert actor given that many CPUs (on a shared machine more than the free cores
    measures the neighbours, not the kernels)."""
    torch.set_num_threads(threads)
    act = activation("silu")
    gen = torch.Generator().manual_seed(seed)
    out: dict = {"benchmark": "grouped_ffn", "hidden": hidden, "inter": inter, "repeats": repeats,
                 "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                             "torch_threads": torch.get_num_threads()}, "cases": []}
    for experts, k, tokens in CASES:
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
            "loop_ms": _best_ms(loop, repeats),
            "grouped_mm_ms": _best_ms(lambda: grouped.run(0, hit, counts, x), repeats),  # noqa: B023
            "bmm_ms": _best_ms(lambda: _bmm(x, counts, stack.gate_up, stack.down, hit, act), repeats),  # noqa: B023
            "grouped_mm_bit_identical": bool(torch.equal(grouped.run(0, hit, counts, x), want)),
            "bmm_bit_identical": bool(torch.equal(_bmm(x, counts, stack.gate_up, stack.down, hit, act), want)),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    text = json.dumps(run(args.hidden, args.inter, args.repeats, threads=args.threads), indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
