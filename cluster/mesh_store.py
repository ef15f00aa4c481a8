"""One mesh's keys in Ray's GCS key-value store: the single place expertmesh touches `internal_kv`.

Every record a mesh keeps in Ray (routing table, controller record, transport secret, Hugging Face token, actor
progress) goes through a `MeshStore`, whose keys carry the mesh's prefix (cluster/naming.py: `expertmesh/<what>` for
the default mesh, `expertmesh/<id>/<what>` for mesh <id>), so meshes sharing a Ray cluster never read each other's.
Needs a connected Ray (ray.init in this process, or a Ray worker).
"""

from __future__ import annotations

from .naming import DEFAULT_MESH_ID, MeshNames


class MeshStore:
    def __init__(self, mesh_id: str = DEFAULT_MESH_ID):
        self.names = MeshNames.of(mesh_id)

    @property
    def mesh_id(self) -> str:
        return self.names.mesh_id

    def get(self, what: str) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(self.names.key(what))

    def put(self, what: str, value: bytes, overwrite: bool = True) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self.names.key(what), value, overwrite=overwrite)

    def get_key(self, key: bytes) -> bytes | None:
        """A key already built with self.names.key (e.g. experts/load_progress.py's)."""
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(key)

    def put_key(self, key: bytes, value: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite=True)

    def delete(self, what: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self.names.key(what))


def cluster_store() -> MeshStore:
    """Keys of the whole Ray cluster rather than of one mesh (the transport secret, the Hugging Face token): they
    keep the names they always had, `expertmesh/<what>`, which is the default mesh's prefix."""
    return MeshStore(DEFAULT_MESH_ID)


def raw_get(key: bytes) -> bytes | None:
    """A key of Ray's own (not a mesh's), e.g. the autoscaler's status; None when absent."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key)
