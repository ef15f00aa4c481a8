"""The controller's recent history, for `expertmesh status`, drills and tests: events (lost, restored, remap, ...)
and elastic control steps, each bounded so a long-running controller keeps a fixed amount. Pure; no Ray."""

from __future__ import annotations

import time

MAX_EVENTS = 1000
MAX_CONTROL_STEPS = 50


class ActivityLog:
    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self.events: list[dict] = []
        self.control: list[dict] = []  # the latest control steps (status shows imbalance before/after)

    def event(self, kind: str, actor: str, **detail) -> None:
        """actor: the actor (or comma-joined actors) it concerns; "-" for none."""
        self.events.append({"t": self.clock(), "kind": kind, "actor": actor, **detail})
        del self.events[:-MAX_EVENTS]

    def control_step(self, entry: dict) -> dict:
        """Keep one control step's outcome; returns it with its time."""
        entry = {"t": self.clock(), **entry}
        self.control.append(entry)
        del self.control[:-MAX_CONTROL_STEPS]
        return entry
