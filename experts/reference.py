"""The in-process reference model: the whole forward pass in one process, pure torch, no Ray.

It is the slow obvious path that the distributed router is tested against (and the oracle for `transformers`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointReader
from .ffn import GatedMLPWeights, activation
from .gating import Routing
from .grouped_ffn import GroupedExperts
from .modeling import MoEDecoder
from .routed_rows import Piece, combine_pieces, sort_rows
from .weights import Shard, load_dense_weights, load_expert_shards


class LocalExperts:
    """ExpertBackend that holds every expert in this process and runs a layer's experts in one grouped call, with
    the same expert math (experts/grouped_ffn.py) and the same combine (experts/routed_rows.py) as the actors and
    the router, so distributed == reference bit for bit."""

    def __init__(self, shards: dict[Shard, GatedMLPWeights], hidden_act: str):
        self.shards = shards
        self.act = activation(hidden_act)
        self.experts = GroupedExperts(shards, self.act)  # re-binds the shards' weights to views of per-layer stacks

    def effective_routing(self, layer: int, routing: Routing) -> Routing:
        return routing  # every expert is always here

    def run(self, layer: int, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        rows = sort_rows(routing.experts)  # every routed (token, slot), grouped by expert
        y = self.experts.run(layer, rows.experts, rows.counts, hidden[rows.tokens])  # [N, H]
        pieces = [Piece(e, t, s, out) for e, t, s, out in zip(
            rows.experts, rows.tokens.split(rows.counts), rows.slots.split(rows.counts), y.split(rows.counts))]
        return combine_pieces(hidden, routing, pieces)  # [T, H]

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
    overlap: bool = False, quant: str = "none",
) -> MoEDecoder:
    """quant: experts.quant of the routed experts ("none", "int8", "int4"), loaded as the actors load them."""
    reader = CheckpointReader(model_dir)
    dense = load_dense_weights(reader, dtype)
    experts = LocalExperts(load_expert_shards(reader, all_shards(reader), dtype, quant=quant),
                           reader.config.hidden_act)
    return MoEDecoder(reader.config, dense, experts, capacity_factor=capacity_factor, overlap=overlap)
