"""`router.overlap: auto`: the decoder asks, step by step, whether two micro-batches pay (cost_model.should_overlap).
Pure: no torch, no Ray; the router passes what it knows of its device and pool.

On a CPU the answer is always no (router and expert actors share the cores: nothing runs side by side, and a split
pays each half's fixed costs twice; measured on the 2-core box: decode η 0.65 plain vs 0.45 overlapped,
docs/benchmarks/dispatch.md). On a GPU it is yes where the half-batch's router work and expert round hide each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .cost_model import Layout, Profile, StepShape, should_overlap
from .cost_profiles import CPU_BASE, gpu_profile, gpu_transports, shape_from_config


def runtime_profile(cfg, device_type: str, device_name: str, transport: str, actors: int) -> Profile | None:
    """The latency profile of a running router: cfg a MoEModelConfig, device_type "cpu" / "cuda", device_name the
    GPU's name, transport the resolved transport, actors the expert actors. None: no profile (unknown GPU)."""
    shape = shape_from_config(cfg)
    layout = Layout(devices=max(1, actors), actors=max(1, actors))
    transports = gpu_transports()
    if device_type != "cuda":
        return Profile(shape, CPU_BASE, transports.get(transport, transports["socket"]), layout)
    hw = gpu_profile(device_name)
    if hw is None or transport not in transports:
        return None
    return Profile(shape, hw, transports[transport], layout)


class StepOverlapPolicy:
    """Called by the decoder per step with the sequences' new-token counts and cached lengths -> overlap or not.
    Decisions are cached per (sequences, tokens, context rounded to a power of two): a step costs a dict lookup."""

    def __init__(self, profile: Profile | None):
        self.profile = profile
        self._seen: dict[tuple[int, int, int], bool] = {}

    def __call__(self, lengths: Sequence[int], starts: Sequence[int]) -> bool:
        if self.profile is None or len(lengths) < 2:
            return False
        context = max(1, sum(starts) // len(starts))
        key = (len(lengths), int(sum(lengths)), 1 << math.ceil(math.log2(context)))
        if key not in self._seen:
            self._seen[key] = should_overlap(StepShape(key[0], key[1], key[2]), self.profile)
        return self._seen[key]
