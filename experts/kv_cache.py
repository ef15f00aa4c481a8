"""The KV cache of one sequence: per layer, what the layer's attention stores per token (its `cache_spec`:
keys and values for GQA, one latent for MLA), appended step by step.

The decoder talks to the cache only through `append` / `history` / `length`, so the storage behind it can change
(a paged pool) without touching the attention layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """layers[i]: entry name -> [L, *shape] (sequence-major, so a batch pads along L), or None before the first step."""

    layers: list[dict[str, torch.Tensor] | None]
    length: int = 0

    @classmethod
    def empty(cls, num_layers: int) -> KVCache:
        return cls(layers=[None] * num_layers)

    def append(self, layer: int, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Add this step's entries ({name: [S, *shape]}) to the layer's history; returns the whole history."""
        held = self.layers[layer]
        if held is not None:
            entries = {name: torch.cat([held[name], new]) for name, new in entries.items()}
        self.layers[layer] = entries
        return entries

    def history(self, layer: int) -> dict[str, torch.Tensor]:
        held = self.layers[layer]
        assert held is not None, f"layer {layer} has no cached history yet"
        return held

    def history_length(self, layer: int) -> int:
        held = self.layers[layer]
        return 0 if held is None else int(next(iter(held.values())).shape[0])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for held in self.layers if held for t in held.values())
