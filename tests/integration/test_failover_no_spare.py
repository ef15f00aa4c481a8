"""A node lost on a cluster with no spare capacity: every CPU and GPU share of the two workers is given out, so the
lost expert actors cannot come back at their normal size anywhere. The controller re-plans their shards onto the
survivor (one stand-in with the lost shards merged, on what the survivor has left: nothing reserved), asks Ray's
autoscaler for the normal shape, and, once a node with room joins (the test plays the autoscaler), starts the lost
actors again under their own names there and retires the stand-in. Traffic flows throughout with the `wait` policy:
no request fails and every output equals the fault-free run's.
"""

from __future__ import annotations

import time

import pytest
import ray
from ray._private import state as ray_state

from expertmesh.cluster.naming import NAMESPACE
from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from tests.clusters import FAKE_GPUS, start_cluster
from tests.tiny_checkpoints import greedy_tokens
from tests.traffic import MAX_TOKENS, NonStopClient, controller_state, mesh_sender, wait_for

# A drill-length module (minutes of Ray, servers and kills): in CI's default set again (CI's limit is 90 minutes;
# the whole run stays well under 45).

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
# Typical on an idle 2-core machine: the stand-in serves ~10 s after the node is removed (a process importing torch,
# loading four shards, warming up); the move back after the node joins takes about as long.
STAND_IN_S = 120
MOVE_BACK_S = 120


@pytest.fixture
def full_cluster():
    """Head without GPUs + two workers of 2 CPUs and 1 (declared) GPU: the pool below takes every share of both."""
    cluster, workers = start_cluster({"num_cpus": 1, "num_gpus": 0, "include_dashboard": False},
                                     [{"num_cpus": 2, "num_gpus": 1}] * 2)
    ray.init(address=cluster.address, namespace=NAMESPACE)
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def free_on(node_id: str) -> dict:
    return ray_state.available_resources_per_node().get(node_id, {})


def events(mesh, kind: str) -> list[dict]:
    return [e for e in controller_state(mesh)["events"] if e["kind"] == kind]


def test_node_lost_without_spare_capacity_is_served_by_a_stand_in_then_moves_back(full_cluster, checkpoints):
    cluster, workers = full_cluster
    config = MeshConfig.from_dict({
        "model": {"path": str(checkpoints["mixtral"])},
        "experts": {"replicas_per_expert": 1, "num_cpus_per_actor": 1.0, "layout": "per-expert"},
        # Long enough to ride out starting a stand-in on a loaded machine: a step holds the lost shards' tokens.
        "failover": {"no_replica_policy": "wait", "wait_timeout_s": 240.0}, "devices": FAKE_GPUS})
    expected = greedy_tokens(load_reference_model(checkpoints["mixtral"]), PROMPT, MAX_TOKENS)
    with ExpertMesh(config) as mesh:
        slots = {s.name: s for s in mesh.slots}
        assert {s.node_id for s in slots.values()} == {w.node_id for w in workers}
        for worker in workers:  # no spare capacity: every CPU and GPU share of the workers is given out
            wait_for(lambda w=worker: free_on(w.node_id).get("CPU", 0.0) == 0.0 == free_on(w.node_id).get("GPU", 0.0),
                     30, "every share taken", detail=lambda w=worker: free_on(w.node_id))
        send = mesh_sender(mesh)
        fault_free = send(PROMPT)
        assert fault_free == expected

        controller_node = ray_state.actors(actor_id=mesh.controller._actor_id.hex())["Address"]["NodeID"]
        victim = next(w for w in workers if w.node_id != controller_node)
        survivor = next(w for w in workers if w is not victim)
        lost = sorted(name for name, slot in slots.items() if slot.node_id == victim.node_id)
        assert len(lost) == 2
        with NonStopClient(send, [PROMPT]) as client:
            client.wait_for_results(2)
            cluster.remove_node(victim)
            removed = time.monotonic()

            def stand_in_serving() -> list[str] | None:
                table = mesh.router.table
                stand_ins = [a for a in table.actors if a.startswith("expert-s")]
                return stand_ins if stand_ins and not set(lost) & set(table.actors) else None

            stand_ins = wait_for(stand_in_serving, STAND_IN_S, "the lost shards served by a stand-in", every=0.25,
                                 detail=lambda: (controller_state(mesh)["events"], sorted(mesh.backend.dead),
                                                 mesh.backend.retried_calls, len(client.results), client.errors))
            stand_in_s = time.monotonic() - removed
            client.wait_for_results(3, timeout=STAND_IN_S)
            (replanned,) = events(mesh, "restore_replanned")
            assert sorted(replanned["actor"].split(",")) == lost
            assert "merged" in replanned["reason"]  # nothing free: both lost actors' shards in one stand-in
            (stand_in,) = stand_ins
            info = ray.get(ray.get_actor(stand_in, namespace=NAMESPACE).info.remote(), timeout=30)
            assert replanned["stand_ins"][stand_in]["node_id"] == survivor.node_id
            assert info["node_id"] == survivor.node_id  # where it was planned (hard affinity)
            assert sorted(map(tuple, info["shards"])) == sorted(
                tuple(s) for name in lost for s in mesh.runtime.spec.actor_shards[name])
            state = controller_state(mesh)
            # The normal shape is asked for: all four actors at their normal share.
            assert state["restore_request"] == [{"CPU": 1.0, "GPU": 0.5}] * 4
            assert set(state["displaced"]) == set(lost)

            # The "autoscaler" answers: a node with room joins; the lost actors come back there as they were.
            new_node = cluster.add_node(num_cpus=2, num_gpus=1)
            cluster.wait_for_nodes()
            wait_for(lambda: events(mesh, "moved_back"), MOVE_BACK_S, "the lost actors moved back", every=0.25,
                     detail=lambda: controller_state(mesh)["events"])
            wait_for(lambda: set(lost) <= set(mesh.router.table.actors) and stand_in not in mesh.router.table.actors,
                     60, "the router on the normal placement again")
            for name in lost:
                back = ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote(), timeout=30)
                assert back["node_id"] == new_node.node_id
            state = controller_state(mesh)
            assert state["restore_request"] == [] and state["displaced"] == {}
            requests = [e for e in state["events"] if e["kind"] == "request_resources"]
            assert [e["bundles"] for e in requests] == [4, 0]  # asked once, released once
            client.wait_for_results(3, timeout=60)
        assert not client.errors, client.errors[:3]
        assert client.results and all(tokens == fault_free for tokens in client.results)
    print(f"stand-in serving {stand_in_s:.1f}s after the node was removed")
