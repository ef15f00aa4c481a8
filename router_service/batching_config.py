"""Continuous batching's settings (router.batcher in the configuration tree). Apart from batching.py, which imports
torch and re-exports the name, so that reading and checking a configuration imports no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatcherConfig:
    max_active: int = 64  # sequences decoding together
    max_waiting: int = 256  # queued requests beyond that; more get QueueFullError
    max_prefill_tokens: int = 2048  # prompt tokens computed in one step; a longer prompt is prefilled in chunks

    def validate(self) -> BatcherConfig:
        for name in ("max_active", "max_waiting", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be ≥ 1, got {getattr(self, name)}")
        return self
