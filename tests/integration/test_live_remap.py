"""Live remap through the controller on a local Ray: while a client generates non-stop, the controller adds a
replica of an expert (loaded and warmed before any router names it), then retires the original (stopped only after
every router switched). Every generation equals the reference, no call is ever retried (so none went to an actor
that was not ready or already stopped), and the new replica really serves.
"""

from __future__ import annotations

import pytest
import ray

from expertmesh.cluster.naming import NAMESPACE, expert_actor_name
from expertmesh.cluster.table_store import read_table
from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from tests.tiny_checkpoints import greedy_tokens
from tests.traffic import NonStopClient, mesh_sender, wait_for

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
MAX_TOKENS = 6


pytestmark = pytest.mark.usefixtures("local_ray")


def test_add_then_retire_a_replica_live(checkpoints):
    expected = greedy_tokens(load_reference_model(checkpoints["mixtral"]), PROMPT, MAX_TOKENS)
    mesh = ExpertMesh(MeshConfig.from_dict({"model": {"path": str(checkpoints["mixtral"])},
                                              "experts": {"num_cpus_per_actor": 0.1, "layout": "per-expert"}}))
    try:
        hot = 0
        original, added = expert_actor_name(hot, 0), expert_actor_name(hot, 1)
        placement = {name: [list(s) for s in shards] for name, shards in mesh.router.table.actors.items()}
        slot = next(s for s in mesh.slots if s.name == original)
        new_slot = {"name": added, "node_id": slot.node_id, "num_cpus": 0.1, "num_gpus": 0.0, "gpu_slot": None}
        with NonStopClient(mesh_sender(mesh, MAX_TOKENS), [PROMPT]) as client:
            wait_for(lambda: len(client.results) >= 2, what="traffic before the remap")
            grown = {**placement, added: placement[original]}
            report = ray.get(mesh.controller.apply_placement.remote(grown, {added: new_slot}), timeout=300)
            assert report["ok"] and report["added"] == [added] and report["retired"] == []
            assert report["routers_behind"] == []  # our router acknowledged the new epoch before anything stopped
            assert mesh.router.table.epoch == report["epoch"] == read_table()["epoch"]
            assert mesh.router.table.replicas[(0, hot)] == (original, added)
            wait_for(lambda: ray.get(ray.get_actor(added, namespace=NAMESPACE).info.remote())["calls"] > 0,
                     what="the new replica to serve")

            moved = {**grown}
            del moved[original]
            report = ray.get(mesh.controller.apply_placement.remote(moved, {}), timeout=300)
            assert report["ok"] and report["retired"] == [original] and report["routers_behind"] == []
            # Stopped (ray.kill is asynchronous: the name goes when the actor has died), and not restored by the
            # controller (no "lost" event below).
            wait_for(lambda: not named(original), timeout=30, what=f"{original} to stop")
            done = len(client.results)
            wait_for(lambda: len(client.results) >= done + 2, what="traffic after the remap")
        assert not client.errors, client.errors
        assert client.results and all(r == expected for r in client.results)
        assert mesh.backend.retried_calls == 0
        assert original not in mesh.router.transport.actors
        events = [e["kind"] for e in ray.get(mesh.controller.get_state.remote())["events"]]
        assert events.count("remap") == 2 and "retired" in events and "lost" not in events
    finally:
        mesh.shutdown()
    with pytest.raises(ValueError):
        ray.get_actor(added, namespace=NAMESPACE)  # shutdown stops replicas a remap added too


def named(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def test_remap_refuses_a_bad_placement(checkpoints):
    mesh = ExpertMesh(MeshConfig.from_dict({"model": {"path": str(checkpoints["mixtral"])},
                                              "experts": {"num_cpus_per_actor": 0.1, "layout": "per-expert"}}))
    try:
        placement = {name: [list(s) for s in shards] for name, shards in mesh.router.table.actors.items()}
        first = next(iter(placement))
        changed = {**placement, first: placement[first][:1]}
        with pytest.raises(ValueError, match="actor_shards"):
            ray.get(mesh.controller.apply_placement.remote(changed, {}))
        with pytest.raises(ValueError, match="slots"):
            ray.get(mesh.controller.apply_placement.remote({**placement, "expert-e9-r9": placement[first]}, {}))
        assert read_table() is None  # nothing was published
    finally:
        mesh.shutdown()
