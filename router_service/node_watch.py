"""The router's node watch: reads Ray's node table every `failover.node_poll_s` and, when a node dies, makes the
expert actors that ran on it dead to this router at once (router_service/replica_health.py) and its calls in flight
to them fail (ActorNodeLost: the transports give up on them, router_service/transports/base.py), so dispatch
retries their rows on other replicas within the same step instead of waiting `failover.call_timeout_s`.

The decision (which nodes died, which actor incarnations were on them) is cluster/node_loss.py's; this is its thread.
Where each actor runs comes from Ray's GCS actor table, looked up once per incarnation (a restored replica has a new
actor id, so it is looked up again and is not lost with its predecessor). How fast Ray itself calls a node dead is
set by its health checks (README: Failover: `health_check_period_ms` x `health_check_failure_threshold`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..cluster.node_loss import NodeWatchState, observe
from .transports.base import LostActors

log = logging.getLogger(__name__)


def actor_node(actor_id: str) -> str | None:
    """The node an actor incarnation runs (or last ran) on, from Ray's GCS actor table; None while it is not placed.

    A DEAD incarnation keeps its node in the table, and it counts: when a node dies Ray marks its actors DEAD in the
    same moment, so a watch that had not located an actor yet (its first polls ran while the actor was still being
    created, as on a loaded box) must still find it on the dead node. A dead incarnation never moves, so caching
    its node is safe."""
    from ray._private import state  # the public state API needs the dashboard, which a drill's Ray may not run

    info = state.actors(actor_id=actor_id)
    if not info or info.get("State") not in ("ALIVE", "DEAD"):
        return None
    node = (info.get("Address") or {}).get("NodeID") or ""
    return node if node.strip("f0") else None  # an empty or nil id: not placed


def ray_nodes() -> list[dict]:
    import ray

    return ray.nodes()


class NodeWatch:
    """Polls the node table on a daemon thread; transports read `lost`, the dispatcher takes the names (take_lost).
    nodes / locate default to Ray (ray.nodes, actor_node); tests pass fakes."""

    def __init__(self, actors: dict[str, Any], poll_s: float, nodes: Callable[[], list[dict]] = ray_nodes,
                 locate: Callable[[str], str | None] = actor_node, clock: Callable[[], float] = time.monotonic):
        self.actors = actors  # the transport's name -> handle map (read only here)
        self.poll_s = poll_s
        self.nodes, self.locate, self.clock = nodes, locate, clock
        self.lost = LostActors()
        self.detections: list[dict] = []  # {"t", "nodes", "actors"} per poll that found a loss (stats and tests)
        self._state = NodeWatchState()
        self._where: dict[str, str | None] = {}  # actor id hex -> node (None: not placed yet, asked again)
        self._handed: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> list[str]:
        """One look at the node table; -> the actor names newly found on a dead node."""
        snapshot = self.nodes()
        placements: dict[tuple[str, str], str | None] = {}
        for name, handle in dict(self.actors).items():
            actor_id = handle._actor_id.hex()
            if self._where.get(actor_id) is None:
                try:
                    self._where[actor_id] = self.locate(actor_id)
                except Exception:  # a GCS hiccup: ask again next poll
                    self._where[actor_id] = None
            placements[(name, actor_id)] = self._where[actor_id]
        current = {actor_id for _, actor_id in placements}
        self._where = {a: n for a, n in self._where.items() if a in current}
        loss, self._state = observe(self._state, snapshot, placements)
        if not loss:
            return []
        names = [name for name, _ in loss.lost]
        if loss.lost:
            self.lost.add(actor_id for _, actor_id in loss.lost)
            with self._lock:
                self._handed.extend(names)
        self.detections.append({"t": time.time(), "nodes": list(loss.dead_nodes), "actors": names})
        del self.detections[:-100]
        unplaced = sorted(name for (name, _), node in placements.items() if node is None)
        log.warning("node watch: node(s) %s dead; expert actors on them: %s%s", list(loss.dead_nodes), names,
                    f"; not located yet: {unplaced}" if unplaced else "")
        return names

    def take_lost(self) -> list[str]:
        """Actor names found on dead nodes since the last call (the dispatcher marks them dead)."""
        if not self._handed:
            return []
        with self._lock:
            names, self._handed = self._handed, []
        return names

    def start(self) -> NodeWatch:
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # the watch must outlive any one bad poll
                log.exception("node watch poll failed")
            self._stop.wait(self.poll_s)

    def stop(self) -> None:
        self._stop.set()
