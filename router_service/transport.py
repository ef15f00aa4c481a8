"""How a batch of tokens reaches an expert actor and its output comes back.

`Transport` is the interface the dispatcher uses; `RayRefTransport` sends every call of a layer as a Ray actor
call (arguments and results travel as object refs) and waits for all of them together.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import ray
import torch

from ..experts.arrays import readonly_tensor


class Transport(Protocol):
    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x: np.ndarray) -> Any:
        """Start one call; returns a handle for `gather`."""
        ...

    def gather(self, handles: list[Any]) -> list[torch.Tensor]:
        """Wait for every handle; outputs in the same order."""
        ...


class RayRefTransport:
    def __init__(self, actors: dict[str, ray.actor.ActorHandle]):
        self.actors = actors

    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x: np.ndarray) -> ray.ObjectRef:
        return self.actors[actor].forward.remote(layer, experts, counts, x)

    def gather(self, handles: list[ray.ObjectRef]) -> list[torch.Tensor]:
        return [readonly_tensor(y) for y in ray.get(handles)]

