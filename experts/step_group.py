"""A step's micro-batch as the decoder's layers see it: some consecutive sequences, their residual stream and rotary
tables (experts/modeling.py runs the layers over it; experts/decode_graphs.py over static ones)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_core import StepLayout
from .kv_cache import KVCache


@dataclass
class StepGroup:
    """A micro-batch of a step: some consecutive sequences, their hidden states and rotary tables."""

    x: torch.Tensor  # [T_g, H] residual stream
    cos: torch.Tensor  # [T_g, R] rotary tables of the group's positions
    sin: torch.Tensor  # [T_g, R]
    positions: torch.Tensor  # [T_g] int64 (Llama 4's NoPE layers scale their queries by position)
    lengths: list[int]
    starts: list[int]
    caches: list[KVCache] | None  # None: a cacheless forward (each sequence is a whole prompt)
    pending: tuple | None = None  # (layer, h [T_g, H], routing, identity, handle) of a submitted expert round
    shortcut: torch.Tensor | None = None  # LongCat: [T_g, H] the MoE output to add after the next sublayer's MLP
    _layout: StepLayout | None = None

    @property
    def layout(self) -> StepLayout:
        """What every layer's attention shares (block tables, slots, masks): built at the group's first layer."""
        if self._layout is None:
            self._layout = StepLayout.build(self.lengths, self.starts, self.caches, self.x.device)
        return self._layout

    def part(self, first: int, last: int) -> StepGroup:
        """Sequences first..last-1 of this group."""
        lo, hi = sum(self.lengths[:first]), sum(self.lengths[:last])
        return StepGroup(self.x[lo:hi], self.cos[lo:hi], self.sin[lo:hi], self.positions[lo:hi],
                      self.lengths[first:last], self.starts[first:last],
                      None if self.caches is None else self.caches[first:last])
