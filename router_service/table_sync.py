"""Routers follow the routing table the controller publishes (cluster/table_store.py).

A background thread polls the published record; on a newer epoch it looks up the actors it does not know yet by
name, waits until each answers `ready` (the controller publishes only warmed actors, so this is quick), and stages
the table on the dispatcher, which switches at the next step boundary. After the switch it tells the controller
which epoch it now routes with, so the controller knows when replaced replicas have no more calls coming and can be
stopped. Nothing here runs on the request path; a failure only delays the switch.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from ..cluster.naming import DEFAULT_MESH_ID, MeshNames
from ..cluster.table_store import read_table, table_of
from .dispatch import RemoteExperts

log = logging.getLogger(__name__)


class TableFollower:
    def __init__(self, backend: RemoteExperts, router_id: str, poll_s: float = 0.5, ready_timeout_s: float = 60.0,
                 heartbeat_s: float = 2.0, idle_apply_s: float = 2.0, mesh_id: str = DEFAULT_MESH_ID):
        self.backend = backend
        self.names = MeshNames.of(mesh_id)  # whose table it follows and whose controller it tells
        self.idle_apply_s = idle_apply_s  # no layer ran this long: switch without waiting for a step
        self.heartbeat_s = heartbeat_s
        self.router_id = router_id
        self.poll_s = poll_s
        self.ready_timeout_s = ready_timeout_s
        self.staged_epoch = backend.table.epoch
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        backend.on_table_applied = self._acknowledge

    def start(self) -> TableFollower:
        self._thread = threading.Thread(target=self._loop, name="table-follower", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        # Report the starting epoch too, so a controller remapping right now counts this router from the start.
        self._acknowledge(self.backend.table.epoch)
        last_heartbeat = time.monotonic()
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
            except Exception:  # a GCS hiccup or an actor not up yet: try again next poll
                log.debug("routing-table poll failed", exc_info=True)
            self.backend.apply_if_idle(self.idle_apply_s)
            if time.monotonic() - last_heartbeat >= self.heartbeat_s:
                # The epoch in use (not the staged one): the controller counts this router live and up to date.
                self._acknowledge(self.backend.table.epoch)
                last_heartbeat = time.monotonic()

    def poll_once(self) -> bool:
        """Stage the published table if it is newer than what we have; True when it staged one."""
        record = read_table(self.names.mesh_id)
        if record is None or record["epoch"] <= self.staged_epoch:
            return False
        table = table_of(record)
        known = self.backend.transport.actors
        new_names = [name for name in table.actors if name not in known]
        handles = {name: ray.get_actor(name, namespace=self.names.namespace) for name in new_names}
        if handles:
            ray.get([h.ready.remote() for h in handles.values()], timeout=self.ready_timeout_s)
        self.backend.stage_table(table, handles, gone=record.get("gone", []))
        self.staged_epoch = table.epoch
        return True

    def _acknowledge(self, epoch: int) -> None:
        """Fire-and-forget: the controller may be down; routers never wait for it."""
        try:
            controller = ray.get_actor(self.names.controller, namespace=self.names.namespace)
            controller.ack_epoch.remote(self.router_id, int(epoch))
        except Exception:
            pass
