"""Continuous batching's settings (router.batcher in the configuration tree). Apart from batching.py, which imports
torch and re-exports the name, so that reading and checking a configuration imports no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

# router.batcher.admission: which waiting requests take free decode slots (router_service/affinity_admission.py).
ADMISSION_POLICIES = ("fifo", "affinity")


@dataclass(frozen=True)
class BatcherConfig:
    max_active: int = 64  # sequences decoding together
    max_waiting: int = 256  # queued requests beyond that; more get QueueFullError
    max_prefill_tokens: int = 2048  # prompt tokens computed in one step; a longer prompt is prefilled in chunks
    # "fifo": oldest first. "affinity": the waiting requests whose predicted experts overlap most with the running
    # batch's (README: Offload, expert-affinity admission); only reorders when more wait than there are free slots.
    admission: str = "fifo"
    affinity_max_wait_s: float = 2.0  # fairness bound: a request waiting this long is admitted first, oldest first
    affinity_experts: int = 0  # experts in a prompt's signature (its most picked); 0: twice the model's top-k

    def validate(self) -> BatcherConfig:
        for name in ("max_active", "max_waiting", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be ≥ 1, got {getattr(self, name)}")
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission: must be one of {ADMISSION_POLICIES}, got {self.admission!r}")
        wait = self.affinity_max_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not (wait >= 0 and math.isfinite(wait)):
            raise ValueError(f"affinity_max_wait_s: must be a finite number ≥ 0, got {wait!r}")
        if isinstance(self.affinity_experts, bool) or not isinstance(self.affinity_experts, int) \
                or self.affinity_experts < 0:
            raise ValueError(f"affinity_experts: must be a whole number ≥ 0, got {self.affinity_experts!r}")
        return self
