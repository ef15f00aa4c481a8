"""The published routing table: which actors serve which shards, at which epoch, kept in Ray's GCS key-value store.

The controller writes a record when the placement changes (replicas added, moved, drained); routers poll it and
switch between steps. The record lives in GCS rather than in the controller's memory, so routers keep following it
while the controller is down or restarting, and a restarted controller starts from the last published placement.

Record format (JSON): {"epoch": int, "actor_shards": {actor name: [[layer, expert], ...]},
                       "slots": {actor name: ActorSlot fields},  (where each actor was placed; for restores)
                       "gone": [actor name, ...]}  (actors this table retires because the controller lost them:
                                                    routers count them dead at once; absent in older records)
"""

from __future__ import annotations

import json

from .mesh_store import MeshStore
from .naming import DEFAULT_MESH_ID
from .routing_table import RoutingTable, Shard

_KEY = "routing-table"  # stored as expertmesh/routing-table (default mesh) or expertmesh/<mesh id>/routing-table


def encode_table(epoch: int, actor_shards: dict[str, list[Shard]], slots: dict[str, dict] | None = None,
                 gone: list[str] | None = None) -> bytes:
    assert epoch >= 0, "epoch must be ≥ 0"
    record = {
        "epoch": int(epoch),
        "actor_shards": {name: [[int(layer), int(expert)] for layer, expert in shards]
                         for name, shards in sorted(actor_shards.items())},
        "slots": slots or {},
        "gone": sorted(gone or []),
    }
    return json.dumps(record).encode()


def decode_table(raw: bytes) -> dict:
    """The record with shards as tuples; ValueError when it is not one."""
    record = json.loads(raw)
    if not isinstance(record, dict) or "epoch" not in record or "actor_shards" not in record:
        raise ValueError("not a routing-table record")
    record["actor_shards"] = {name: [(int(s[0]), int(s[1])) for s in shards]
                              for name, shards in record["actor_shards"].items()}
    record.setdefault("slots", {})
    record.setdefault("gone", [])
    return record


def table_of(record: dict) -> RoutingTable:
    return RoutingTable.from_actor_shards(record["actor_shards"], epoch=int(record["epoch"]))


def publish_table(epoch: int, actor_shards: dict[str, list[Shard]], slots: dict[str, dict] | None = None,
                  gone: list[str] | None = None, mesh_id: str = DEFAULT_MESH_ID) -> None:
    MeshStore(mesh_id).put(_KEY, encode_table(epoch, actor_shards, slots, gone))


def read_table(mesh_id: str = DEFAULT_MESH_ID) -> dict | None:
    """Mesh `mesh_id`'s last published record, or None when nothing was published (the pool's initial table
    applies)."""
    raw = MeshStore(mesh_id).get(_KEY)
    return decode_table(raw) if raw else None


def clear_table(mesh_id: str = DEFAULT_MESH_ID) -> None:
    MeshStore(mesh_id).delete(_KEY)
