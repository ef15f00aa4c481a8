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

from .routing_table import RoutingTable, Shard

_KV_KEY = b"expertmesh/routing-table"


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
                  gone: list[str] | None = None) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_KV_KEY, encode_table(epoch, actor_shards, slots, gone), overwrite=True)


def read_table() -> dict | None:
    """The last published record, or None when nothing was published (the pool's initial table applies)."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_KV_KEY)
    return decode_table(raw) if raw else None


def clear_table() -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_KV_KEY)
