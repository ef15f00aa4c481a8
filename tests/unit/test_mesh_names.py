"""Mesh ids: the names and stored keys every mesh derives from its id (cluster/naming.py, cluster/mesh_store.py),
the `mesh.id` setting and --mesh-id flag, and the id travelling in the pool description."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import pytest

from expertmesh.cluster.mesh_store import MeshStore, cluster_store
from expertmesh.cluster.naming import (
    CONTROLLER_NAME,
    DEFAULT_MESH,
    NAMESPACE,
    RESERVED_MESH_IDS,
    MeshNames,
    mesh_id_problem,
)
from expertmesh.cluster.pool_spec import PoolSpec
from expertmesh.cluster.table_store import clear_table, publish_table, read_table
from expertmesh.experts.load_progress import progress_key
from expertmesh.ops.commands.mesh_flags import add_mesh_flags, mesh_config_from_args
from expertmesh.router_service.config import ConfigError, MeshConfig


def test_default_mesh_keeps_todays_names():
    names = MeshNames.of()
    assert names == DEFAULT_MESH
    assert (names.mesh_id, names.namespace, names.controller) == ("default", "expertmesh", "controller")
    assert (NAMESPACE, CONTROLLER_NAME) == ("expertmesh", "controller")
    assert names.key("routing-table") == b"expertmesh/routing-table"
    assert names.key("controller") == b"expertmesh/controller"
    assert names.app_name == "expertmesh"
    assert progress_key("expert-e3-r0") == b"expertmesh/load/expert-e3-r0"


def test_another_mesh_gets_its_own_namespace_and_keys():
    names = MeshNames.of("chat")
    assert names.namespace == "expertmesh-chat"
    assert names.controller == "controller"  # Ray names are per namespace
    assert names.key("routing-table") == b"expertmesh/chat/routing-table"
    assert names.app_name == "expertmesh-chat"
    assert progress_key("expert-e3-r0", "chat") == b"expertmesh/chat/load/expert-e3-r0"
    assert MeshNames.of("chat") == names  # pure: the same id, the same names, in any process


def test_no_two_meshes_share_a_namespace_or_a_key():
    ids = ["default", "a", "chat", "chat-2", "m0", "x" * 40]
    all_names = [MeshNames.of(i) for i in ids]
    assert len({n.namespace for n in all_names}) == len(ids)
    whats = ["routing-table", "controller", "load/expert-e0-r0"]
    keys = [n.key(w) for n in all_names for w in whats]
    assert len(set(keys)) == len(keys)
    # A mesh id equal to a default-mesh key's first segment is refused, so its keys cannot land among the default's.
    for reserved in RESERVED_MESH_IDS:
        assert mesh_id_problem(reserved) is not None


@pytest.mark.parametrize("bad", ["", "Chat", "-chat", "chat-", "ch_at", "ch.at", "ch/at", "x" * 41, "é", "a b",
                                 "load", 3, None])
def test_mesh_ids_are_dns_labels(bad):
    assert mesh_id_problem(bad) is not None
    with pytest.raises(ValueError, match="mesh id"):
        MeshNames.of(bad)


@pytest.mark.parametrize("good", ["default", "a", "0", "chat", "mixtral-8x7b", "x" * 40])
def test_good_mesh_ids(good):
    assert mesh_id_problem(good) is None


def test_keys_are_relative_paths():
    with pytest.raises(ValueError):
        DEFAULT_MESH.key("")
    with pytest.raises(ValueError):
        DEFAULT_MESH.key("/routing-table")


def parse(*argv: str) -> MeshConfig:
    parser = argparse.ArgumentParser()
    add_mesh_flags(parser)
    return mesh_config_from_args(parser.parse_args(list(argv)))


def test_mesh_id_setting_and_flag():
    assert MeshConfig().mesh.id == "default"
    assert parse("--mesh-id", "chat").mesh.id == "chat"
    config = MeshConfig.from_dict({"mesh": {"id": "code"}}).validate()
    assert config.mesh.id == "code"
    assert MeshConfig.from_dict(config.to_dict()).mesh.id == "code"
    with pytest.raises(ConfigError, match="^mesh.id: must be 1-40 lower-case letters"):
        parse("--mesh-id", "Chat")
    with pytest.raises(ConfigError, match="^mesh.id: 'load' is reserved"):
        MeshConfig.from_dict({"mesh": {"id": "load"}}).validate()


def test_pool_spec_carries_the_mesh_id_to_other_processes():
    from expertmesh.router_service.deployment import pool_spec_from_dict

    spec = PoolSpec("m", "auto", {"expert-e0-r0": [(1, 0)]}, mesh_id="chat")
    assert spec.names.namespace == "expertmesh-chat"
    assert spec.with_actor_shards({"expert-e0-r1": [[1, 0]]}).mesh_id == "chat"  # restores, remaps keep it
    shipped = pool_spec_from_dict(asdict(spec))  # what Serve gives a router replica
    assert shipped.mesh_id == "chat" and shipped.actor_shards == spec.actor_shards
    legacy = asdict(spec)
    del legacy["mesh_id"]  # a pool dict from before mesh ids: the default mesh
    assert pool_spec_from_dict(legacy).mesh_id == "default"


@pytest.fixture
def fake_kv(monkeypatch):
    import ray
    from ray.experimental import internal_kv

    store: dict[bytes, bytes] = {}

    def put(key, value, overwrite=True):
        if overwrite or key not in store:
            store[key] = value

    monkeypatch.setattr(internal_kv, "_internal_kv_put", put)
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda k: store.get(k))
    monkeypatch.setattr(internal_kv, "_internal_kv_del", lambda k: store.pop(k, None))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    return store


def test_each_mesh_reads_and_clears_only_its_own_table(fake_kv):
    publish_table(3, {"expert-e0-r0": [(1, 0)]})
    publish_table(7, {"expert-e0-r0": [(1, 0)], "expert-e0-r1": [(1, 0)]}, mesh_id="chat")
    assert set(fake_kv) == {b"expertmesh/routing-table", b"expertmesh/chat/routing-table"}
    assert read_table()["epoch"] == 3
    assert read_table("chat")["epoch"] == 7
    assert read_table("code") is None
    clear_table("chat")
    assert read_table("chat") is None and read_table()["epoch"] == 3


def test_mesh_store_prefixes_every_key(fake_kv):
    MeshStore("chat").put("controller", b"{}")
    MeshStore().put("controller", b'{"epoch": 1}')
    assert fake_kv == {b"expertmesh/chat/controller": b"{}", b"expertmesh/controller": b'{"epoch": 1}'}
    assert MeshStore("chat").get("controller") == b"{}"
    MeshStore("chat").put("controller", b"x", overwrite=False)
    assert MeshStore("chat").get("controller") == b"{}"
    MeshStore("chat").delete("controller")
    assert MeshStore("chat").get("controller") is None
    assert cluster_store().names == DEFAULT_MESH  # cluster-wide keys keep their expertmesh/<what> names


def test_the_transport_secret_is_the_clusters(fake_kv):
    from expertmesh.experts.transport_secret import transport_secret

    first = transport_secret()
    assert transport_secret() == first and fake_kv == {b"expertmesh/transport-secret": first.encode()}
