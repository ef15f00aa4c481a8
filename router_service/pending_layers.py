"""A layer's expert round between `submit` and `wait` (router_service/dispatch.py), and the rounds still out. Pure
bookkeeping (no Ray): live remap asks which actors may still answer a call of this step before it retires them
(table_switch.py apply_while_held).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..experts.gating import Routing
from .dispatch_plan import ActorCall


@dataclass(eq=False)  # a round is equal only to itself (InFlight finds it by identity; tensors have no truth value)
class PendingLayer:
    """A layer's expert round between `submit` and `wait`."""

    layer: int
    hidden: torch.Tensor  # [T, H] on the router's device: where the combine adds up
    rows_from: torch.Tensor  # [T, H] where every call's rows are gathered from: the host copy, or `hidden` itself
    # for a transport that sends device rows (experts/device_rule.py: gather_rows)
    routing: Routing  # as the gate chose, in host memory (experts/device_rule.py)
    served: Routing  # after the no-replica policy
    calls: list[ActorCall]
    handles: list  # the first round's transport handles
    shed: torch.Tensor | None  # [E] slots moved off each expert by overload shedding (None: shedding off)
    deadline: float  # the `wait` policy's bound (clock)
    give_up: float  # the whole layer's bound (clock)
    carrier: dict[str, str] | None  # trace context sent with every call
    span: object | None  # the layer's dispatch span (ended in wait)
    started: float  # perf_counter at submit
    busy_s: float = 0.0  # time submit took


class InFlight:
    """Layers submitted and not yet waited for, in submit order: their calls may still be out."""

    def __init__(self) -> None:
        self.layers: list[PendingLayer] = []

    def add(self, pending: PendingLayer) -> None:
        self.layers.append(pending)

    def discard(self, pending: PendingLayer) -> None:
        if pending in self.layers:
            self.layers.remove(pending)

    def clear(self) -> None:
        """A new step: a step that failed may have left layers it never waited for."""
        self.layers = []

    def actors(self) -> set[str]:
        """Actors called by a layer still out (including calls that replaced failed ones)."""
        return {call.actor for pending in self.layers for call in pending.calls}
