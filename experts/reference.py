"""The in-process reference model: the whole forward pass in one process, pure torch, no Ray.

It is the slow obvious path that the distributed router is tested against (and the oracle for `transformers`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointReader
from .ffn import GatedMLPWeights, activation, gated_mlp
from .gating import Routing
from .modeling import MoEDecoder
from .weights import Shard, load_dense_weights, load_expert_shards


class LocalExperts:
    """ExpertBackend that holds every expert in this process and runs them one after another."""

    def __init__(self, shards: dict[Shard, GatedMLPWeights], hidden_act: str):
        self.shards = shards
        self.act = activation(hidden_act)

    def effective_routing(self, layer: int, routing: Routing) -> Routing:
        return routing  # every expert is always here

    def run(self, layer: int, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        out = torch.zeros_like(hidden)  # [T, H]
        for expert in torch.unique(routing.experts[routing.experts >= 0]).tolist():
            token_idx, slot = torch.nonzero(routing.experts == expert, as_tuple=True)
            y = gated_mlp(hidden[token_idx], self.shards[(layer, expert)], self.act)  # [n, H]
            out.index_add_(0, token_idx, (y * routing.weights[token_idx, slot, None]).to(hidden.dtype))
        return out

    # `run` in two halves, so the decoder's overlap schedule runs in process too (the work happens in submit).
    def submit(self, layer: int, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.run(layer, hidden, routing)

    def wait(self, pending: torch.Tensor) -> torch.Tensor:
        return pending


def all_shards(reader: CheckpointReader) -> list[Shard]:
    cfg = reader.config
    return [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)]


def load_reference_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, capacity_factor: float | None = None,
    overlap: bool = False,
) -> MoEDecoder:
    reader = CheckpointReader(model_dir)
    dense = load_dense_weights(reader, dtype)
    experts = LocalExperts(load_expert_shards(reader, all_shards(reader), dtype), reader.config.hidden_act)
    return MoEDecoder(reader.config, dense, experts, capacity_factor=capacity_factor, overlap=overlap)
