"""The state cache beside the paged KV cache: per sequence, a fixed-size state for each linear-attention layer
(Qwen3-Next / Qwen3.5's Gated DeltaNet: the conv1d's last K-1 inputs and the recurrent matrix per value head).

Unlike a KV history the state does not grow with the sequence, so it is a slot, not blocks: the pool holds, per
linear layer and state name, one tensor [slots, *shape] allocated once (the conv state in the model dtype, the
recurrent state float32, as transformers keeps them). A sequence (experts/kv_cache.py `KVCache`) takes a slot with
its first tokens (`reserve`), zeroed, and gives it back with its blocks (`free`: end, cancel, or preemption; a
preempted sequence recomputes prompt + generated tokens on resume, which rebuilds the state). Admission checks a
slot is free as it checks blocks (router_service/batching.py `_admit`); the slots' bytes come out of the KV budget
(`PagedKVPool.plan`).

A state holds the whole prefix, not a block of it, so prefix caching is off for models with linear layers (a cached
block would give the attention layers their keys but not the linear layers their state at that point).
"""

from __future__ import annotations

import math

import torch

from .block_allocator import OutOfBlocks


class OutOfStateSlots(OutOfBlocks):
    """Every state slot is held; nothing was allocated (an OutOfBlocks, so callers that wait for room treat both
    alike)."""

    def __init__(self, slots: int):
        RuntimeError.__init__(self, f"state cache: all {slots} sequence slots are in use")
        self.wanted, self.free = 1, 0


StateShapes = dict[str, tuple[int, ...]]  # state name -> per-sequence shape ("conv", "recurrent")
FLOAT32_STATES = ("recurrent",)  # kept in at least float32 whatever the model dtype


def state_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype state `name` is kept in for a model in `dtype` (float32 for bf16/fp32 models, as transformers)."""
    return torch.promote_types(torch.float32, dtype) if name in FLOAT32_STATES else dtype


def state_bytes_per_sequence(shapes: list[StateShapes], dtype: torch.dtype) -> int:
    """Bytes one sequence's state takes over every layer (0 for a model without linear layers)."""
    return sum(math.prod(shape) * torch.empty((), dtype=state_dtype(name, dtype)).element_size()
               for layer in shapes for name, shape in layer.items())


class StatePool:
    def __init__(self, shapes: list[StateShapes], slots: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        """shapes: per layer, its states (empty for attention layers); slots: how many sequences can hold one."""
        assert slots >= 1, slots
        self.shapes = shapes
        self.slots = slots
        self.dtype = dtype
        self.device = torch.device(device)
        self.storage: list[dict[str, torch.Tensor]] = [
            {name: torch.zeros((slots, *shape), dtype=state_dtype(name, dtype), device=self.device)
             for name, shape in layer.items()}
            for layer in shapes
        ]
        self._free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.storage for t in layer.values())

    def allocate(self) -> int:
        """A free slot, zeroed (a sequence's state starts at zero); OutOfBlocks when none is free."""
        if not self._free:
            raise OutOfStateSlots(self.slots)
        slot = self._free.pop()
        for layer in self.storage:
            for t in layer.values():
                t[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"state slot {slot} released twice"
        self._free.append(slot)

    def views(self, layer: int, slots: list[int]) -> dict[str, list[torch.Tensor]]:
        """name -> per slot its state tensor at `layer` (views: writing them updates the pool)."""
        return {name: [t[s] for s in slots] for name, t in self.storage[layer].items()}
