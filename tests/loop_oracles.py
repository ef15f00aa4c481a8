"""Main's per-expert expert compute (LocalExperts.run as it was before experts/grouped_ffn.py): the slow obvious
oracle the grouped code must equal bit for bit. The planning and combining loops live with the benchmark that times
them (expertmesh.ops.bench.dispatch_overhead)."""

from __future__ import annotations

import torch

from expertmesh.cluster.routing_table import Shard
from expertmesh.experts.ffn import GatedMLPWeights, gated_mlp
from expertmesh.experts.gating import Routing


def loop_local_run(shards: dict[Shard, GatedMLPWeights], act, layer: int, hidden: torch.Tensor,
                   routing: Routing) -> torch.Tensor:
    """Main's LocalExperts.run: one gated_mlp and one index_add_ per expert."""
    out = torch.zeros_like(hidden)  # [T, H]
    for expert in torch.unique(routing.experts[routing.experts >= 0]).tolist():
        token_idx, slot = torch.nonzero(routing.experts == expert, as_tuple=True)
        y = gated_mlp(hidden[token_idx], shards[(layer, expert)], act)  # [n, H]
        out.index_add_(0, token_idx, (y * routing.weights[token_idx, slot, None]).to(hidden.dtype))
    return out
