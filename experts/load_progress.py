"""How far each expert actor got loading its weights: bytes read of bytes to read, published while it loads.

An actor's `__init__` reads its shards before Ray lets anyone call it, so `info()` cannot answer "how far along"
for a 20 GB shard set on a cloud disk. The actor publishes a small record to Ray's GCS key-value store instead
(throttled), keyed by its name, and `expertmesh status` shows it next to the replicas that are not up yet. Pure: the
store is passed in as put/get callables (the actor and the server pass Ray's internal KV).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..cluster.naming import DEFAULT_MESH_ID, MeshNames

KEY_PREFIX = "expertmesh/load/"  # the default mesh's; mesh <id>: expertmesh/<id>/load/


@dataclass(frozen=True)
class LoadProgress:
    actor: str
    loaded_bytes: int
    total_bytes: int
    done: bool = False
    error: str | None = None
    updated: float = 0.0  # unix seconds

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> LoadProgress:
        return cls(**json.loads(raw))

    @property
    def fraction(self) -> float:
        return 1.0 if self.total_bytes <= 0 else min(1.0, self.loaded_bytes / self.total_bytes)


def progress_key(actor: str, mesh_id: str = DEFAULT_MESH_ID) -> bytes:
    return MeshNames.of(mesh_id).key(f"load/{actor}")


class ProgressReporter:
    """Counts bytes as tensors arrive and publishes at most every `every_s` (and always at the end)."""

    def __init__(self, actor: str, total_bytes: int, put: Callable[[bytes, bytes], None], every_s: float = 0.5,
                 clock: Callable[[], float] = time.time, mesh_id: str = DEFAULT_MESH_ID):
        self.actor, self.total, self.put, self.every_s, self.clock = actor, total_bytes, put, every_s, clock
        self.mesh_id = mesh_id
        self.loaded = 0
        self._last = float("-inf")
        self._publish(done=False)

    def add(self, nbytes: int) -> None:
        self.loaded += nbytes
        if self.clock() - self._last >= self.every_s:
            self._publish(done=False)

    def finish(self, error: str | None = None) -> None:
        self._publish(done=error is None, error=error)

    def _publish(self, done: bool, error: str | None = None) -> None:
        now = self.clock()
        self._last = now
        record = LoadProgress(self.actor, self.loaded, self.total, done, error, now)
        try:
            self.put(progress_key(self.actor, self.mesh_id), record.encode())
        except Exception:  # progress is advisory: a store hiccup must not fail a load
            pass


def read_progress(actor: str, get: Callable[[bytes], bytes | None],
                  mesh_id: str = DEFAULT_MESH_ID) -> LoadProgress | None:
    try:
        raw = get(progress_key(actor, mesh_id))
        return None if raw is None else LoadProgress.decode(raw)
    except Exception:
        return None
