"""What routers tell the controller: the epoch each routes with, and its latest load snapshot. Pure; no Ray.

Routers acknowledge every table switch (and repeat it as a heartbeat), so a remap knows when no router still uses
an actor it retires; they push load snapshots (cluster/load_stats.py format) that the elastic loop and `expertmesh
status` merge. Routers that stop reporting (scaled in, died) drop out after a while. `now` is passed in (time.time()
in the controller) so tests use a fake clock.
"""

from __future__ import annotations

from .load_stats import merge_snapshots

FORGET_LOAD_S = 300.0  # a router's snapshot is dropped after this long (or max_age_s, if longer) without a new one


class RouterReports:
    def __init__(self) -> None:
        self.epochs: dict[str, tuple[float, int]] = {}  # router id -> (heard at, epoch it routes with)
        self.loads: dict[str, tuple[float, dict]] = {}  # router id -> (received at, its latest load snapshot)

    def ack(self, router_id: str, epoch: int, now: float) -> None:
        self.epochs[router_id] = (now, int(epoch))

    def behind(self, epoch: int, now: float, ttl_s: float) -> list[str]:
        """Live routers (heard from within ttl_s) that still route with an older table than `epoch`."""
        return sorted(r for r, (heard, e) in self.epochs.items() if e < epoch and now - heard <= ttl_s)

    def report_load(self, router_id: str, snapshot: dict, now: float) -> None:
        self.loads[router_id] = (now, snapshot)

    def merged_load(self, now: float, max_age_s: float) -> dict | None:
        """Every router's snapshot from within max_age_s merged into one (counts summed, health recomputed), or None
        when none is that recent."""
        for router_id in [r for r, (t, _) in self.loads.items() if now - t > max(max_age_s, FORGET_LOAD_S)]:
            del self.loads[router_id]
        return merge_snapshots([snap for t, snap in self.loads.values() if now - t <= max_age_s])
