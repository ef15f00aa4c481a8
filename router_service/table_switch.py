"""Live remap on the router: which routing table a step uses, and when a newer one takes over. Pure (no Ray, no
torch), so the switching rules are unit-tested with plain threads.

A newer table (and handles to its new actors) is staged by the table follower (table_sync.py) and waits until the
next step starts: a step never mixes two placements. The decoder marks steps with begin_step/end_step (with overlap,
a step's layers run as two interleaved micro-batches, so no layer order can tell where a step starts). Two
exceptions: an idle router switches at once (apply_if_idle), and a step held for lack of a replica may switch inside
the step when the new table strands no call that could still succeed (apply_while_held).

What a switch does to the transport's actor handles and the replicas' health is the caller's `adopt` callback
(router_service/dispatch.py); this object only keeps the table, the staged one and the step bookkeeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..cluster.routing_table import RoutingTable

# adopt(table, new_actors): make `table` usable before it becomes current (add its new actors' handles, drop the
# actors it retires)
Adopt = Callable[[RoutingTable, dict], None]


class TableSwitch:
    """The current routing table, a staged successor, and the step guard that keeps switches between steps."""

    def __init__(self, table: RoutingTable, adopt: Adopt):
        self.table = table
        self.adopt = adopt
        self.on_table_applied: Callable[[int], None] | None = None  # called with the epoch after each switch
        self._staged: tuple[RoutingTable, dict] | None = None
        self._staged_lock = threading.Lock()
        self.step_lock = threading.Lock()  # guards steps_running / last_active against the idle-time switch
        # Held from begin_step to end_step (and through a bare round): forwards from several threads take turns
        # per step, so no two rounds share a transport at once and no switch lands inside a step.
        self.step_guard = threading.RLock()
        self.steps_running = 0
        self.last_active = 0.0  # when the last step ended or the last bare round finished (time.monotonic)

    @property
    def staged_table(self) -> RoutingTable | None:
        staged = self._staged
        return None if staged is None else staged[0]

    def stage(self, table: RoutingTable, new_actors: dict) -> None:
        """Switch to `table` when the next step starts. new_actors: handles of actors the current table does not
        name yet (already loaded and warm)."""
        with self._staged_lock:
            self._staged = (table, dict(new_actors))

    def apply_staged(self) -> None:
        with self._staged_lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self._switch_to(*staged)

    def _switch_to(self, table: RoutingTable, new_actors: dict) -> None:
        self.adopt(table, new_actors)
        self.table = table
        if self.on_table_applied is not None:
            self.on_table_applied(table.epoch)

    def apply_while_held(self, busy: Callable[[], set[str]]) -> bool:
        """Inside a step held by the `wait` policy, or retrying a layer whose calls failed: switch to a staged table
        now unless it retires an actor in busy() - those that may still answer a call of this step (one in flight
        from a layer submitted but not yet waited for, neither dead nor failed). So the switch strands no call that
        could succeed, and a step waiting for lost replicas reaches the stand-ins the controller starts under new
        names when the survivors have no room to restore them as they were. (The controller stops a retired actor
        only after this router acknowledges the table, which the switch does.)"""
        with self.step_lock:
            with self._staged_lock:
                staged = self._staged
                if staged is None:
                    return False
                still_out = busy()
                if any(a in still_out for a in self.table.actors if a not in staged[0].actors):
                    return False
                self._staged = None
            self._switch_to(*staged)
        return True

    def begin_step(self, reset: Callable[[], None]) -> None:
        """The decoder starts a forward: switch to a staged table now, then no switch until end_step (same thread).
        reset: the caller's per-step state, cleared under the same lock."""
        self.step_guard.acquire()
        try:
            with self.step_lock:
                if self._staged is not None:
                    self.apply_staged()
                self.steps_running += 1
                reset()
        except BaseException:
            self.step_guard.release()
            raise

    def end_step(self) -> None:
        with self.step_lock:
            self.steps_running = max(0, self.steps_running - 1)
            self.last_active = time.monotonic()
        self.step_guard.release()

    def round_done(self) -> None:
        """A layer's round finished: outside a step (a bare round), that is the router's last activity."""
        if not self.steps_running:
            self.last_active = time.monotonic()

    def apply_if_idle(self, idle_s: float) -> bool:
        """Switch to a staged table now when no step is running and none ended within idle_s (an idle router
        would otherwise hold on to the old table, and the controller wait for it, until its next request)."""
        if self._staged is None or not self.step_guard.acquire(blocking=False):
            return False
        try:
            with self.step_lock:
                if self.steps_running or time.monotonic() - self.last_active < idle_s or self._staged is None:
                    return False
                self.apply_staged()
                return True
        finally:
            self.step_guard.release()
