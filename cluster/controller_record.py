"""The controller's persisted record: what a restarted controller cannot rebuild from the live actors. Pure; no Ray
until `load_record` / `save_record` touch the mesh's store (cluster/mesh_store.py).

A restarted controller learns generations and nodes by probing the actors, and the placement from the published
routing table (cluster/table_store.py); this record keeps the rest. Format (JSON, stored under the mesh's
"controller" key; readers accept older records lacking any field):

    {"epoch": int, "drained": [actor, ...],
     "displaced": {lost actor: {"slot": ActorSlot fields, "shards": [[layer, expert], ...], "by": stand-in or null}},
     "stand_in_serial": int,            # the next stand-in is expert-s<serial>
     "restore_request": [bundle, ...]}  # what was asked of Ray's autoscaler for the displaced actors

`{}` (written by a fresh start) means "no previous incarnation".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .mesh_store import MeshStore

_KEY = "controller"  # the controller's record, in its mesh's store


@dataclass
class ControllerRecord:
    epoch: int = 0
    drained: set[str] = field(default_factory=set)
    displaced: dict[str, dict] = field(default_factory=dict)
    stand_in_serial: int = 0
    restore_request: list[dict] = field(default_factory=list)

    def encode(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "drained": sorted(self.drained), "displaced": self.displaced,
                           "stand_in_serial": self.stand_in_serial,
                           "restore_request": self.restore_request}).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> tuple[ControllerRecord, bool]:
        """(record, whether a previous incarnation left one); an absent or `{}` record gives the defaults."""
        saved = json.loads(raw) if raw else {}
        return cls(epoch=int(saved.get("epoch", 0)), drained=set(saved.get("drained", [])),
                   displaced=dict(saved.get("displaced", {})), stand_in_serial=int(saved.get("stand_in_serial", 0)),
                   restore_request=list(saved.get("restore_request", []))), bool(saved)


def load_record(mesh_id: str) -> tuple[ControllerRecord, bool]:
    return ControllerRecord.decode(MeshStore(mesh_id).get(_KEY))


def save_record(mesh_id: str, record: ControllerRecord) -> None:
    MeshStore(mesh_id).put(_KEY, record.encode())


def clear_record(mesh_id: str) -> None:
    """A fresh deployment: the next controller starts from nothing (an empty record, not an absent key, as before)."""
    MeshStore(mesh_id).put(_KEY, b"{}")
