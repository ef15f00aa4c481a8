"""The batcher's per-sequence routing counts (batching.step_routing, whole-step tensor ops) against the obvious
loop over sequences they replaced: same counts, drops, degraded and rerouted slots, with recomputed tokens skipped."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.gating import Routing
from expertmesh.router_service.batching import step_routing

E, K = 6, 2


def _obvious(routings, lengths, skip):
    out = []
    for i in range(len(lengths)):
        start = sum(lengths[:i])
        fresh = slice(start + skip[i], start + lengths[i])
        row = {"tpe": {}, "dropped": 0, "degraded": 0, "rerouted": 0}
        for layer, r in routings.items():
            experts = r.experts[fresh]
            row["tpe"][layer] = torch.bincount(experts[experts >= 0], minlength=E).tolist()
            row["dropped"] += int((experts < 0).sum())
            if r.degraded_per_token is not None:
                row["degraded"] += int(r.degraded_per_token[fresh].sum())
            if r.rerouted_per_token is not None:
                row["rerouted"] += int(r.rerouted_per_token[fresh].sum())
        out.append(row)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_step_routing_equals_the_per_sequence_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
    skip = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lengths]  # up to every token recomputed
    tokens = sum(lengths)
    routings = {}
    for layer in (0, 3):
        experts = torch.randint(-1, E, (tokens, K), generator=gen)  # -1: dropped slots
        extra = {}
        if layer == 3:
            extra = {"degraded_per_token": torch.randint(0, 3, (tokens,), generator=gen),
                     "rerouted_per_token": torch.randint(0, 2, (tokens,), generator=gen)}
        routings[layer] = Routing(experts=experts, weights=torch.ones(tokens, K), **extra)
    got = step_routing(routings, lengths, skip, E)
    want = _obvious(routings, lengths, skip)
    assert [{"tpe": {layer: c.tolist() for layer, c in g.tokens_per_expert.items()}, "dropped": g.dropped,
             "degraded": g.degraded, "rerouted": g.rerouted} for g in got] == want
    assert sum(w["dropped"] for w in want) + sum(sum(sum(v) for v in w["tpe"].values()) for w in want) == \
        2 * K * sum(n - s for n, s in zip(lengths, skip))  # every fresh slot counted once per layer
