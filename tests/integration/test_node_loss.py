"""A node with expert actors removed under traffic, on the drill's own Ray (ops/drill/ray_start.py: loopback, Ray's
node health checks shortened): the router's node watch (router_service/node_watch.py) and the controller's
(cluster/restore_flow.py node_check) both see it in Ray's node table within 2 s; calls in flight to its actors are
given up on and retried on the other replicas in the same step; the controller, placed on the head node, restores
the lost actors it has not found lost from their probes yet together (one re-plan). No request fails and every output
equals the fault-free one.
"""

from __future__ import annotations

import time

import pytest
import ray
from ray._private import state as ray_state

from expertmesh.cluster.controller_placement import HEAD_RESOURCE
from expertmesh.cluster.naming import NAMESPACE
from expertmesh.ops.drill.ray_start import leave_loopback_mode, start_node_cluster
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from tests.clusters import FAKE_GPUS
from tests.traffic import NonStopClient, controller_state, mesh_sender, wait_for

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
DETECT_S = 2.0  # the target: node loss seen from Ray's node table within 2 s


@pytest.fixture
def drill_cluster():
    """The drill's node cluster: a 1-CPU head (no GPUs, so it hosts no experts) and two workers of 2 CPUs and one
    declared GPU each, on loopback with the fast health checks; this driver joined."""
    if ray.is_initialized():
        ray.shutdown()
    try:
        cluster, _ = start_node_cluster(nodes=2, node_cpus=2, node_gpus=1, namespace=NAMESPACE)
    except Exception as exc:  # noqa: BLE001 - a raylet slow to register on a loaded box (tests/clusters.py says why)
        leave_loopback_mode()
        if "timed out during startup" not in str(exc):
            raise
        time.sleep(5)
        cluster, _ = start_node_cluster(nodes=2, node_cpus=2, node_gpus=1, namespace=NAMESPACE)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    leave_loopback_mode()


def node_of(actor_id: str) -> str:
    return ray_state.actors(actor_id=actor_id)["Address"]["NodeID"]


def test_node_removed_under_traffic_is_seen_within_2s_and_no_request_fails(drill_cluster, checkpoints):
    cluster = drill_cluster
    head = next(n["NodeID"] for n in ray.nodes() if n["Resources"].get(HEAD_RESOURCE))
    assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in ray.nodes()), "the drill's Ray binds loopback"
    config = MeshConfig.from_dict({
        "model": {"path": str(checkpoints["mixtral"])},
        # two replicas of every expert, one per worker: a lost node's shards keep a live replica
        "experts": {"replicas_per_expert": 2, "num_cpus_per_actor": 0.5, "layout": "per-expert"},
        "router": {"transport": "refs"},
        "failover": {"no_replica_policy": "wait", "wait_timeout_s": 120.0}, "devices": FAKE_GPUS})
    with ExpertMesh(config) as mesh:
        assert node_of(mesh.controller._actor_id.hex()) == head, "controller.placement head"
        send = mesh_sender(mesh)
        fault_free = send(PROMPT)
        actor_nodes = {name: node_of(h._actor_id.hex()) for name, h in mesh.backend.transport.actors.items()}
        victim = next(w for w in cluster.worker_nodes if w.node_id in actor_nodes.values())
        lost = sorted(n for n, node in actor_nodes.items() if node == victim.node_id)
        transport = mesh.backend.transport
        lost_ids = {n: transport.actors[n]._actor_id for n in lost}
        assert lost and len(lost) < len(actor_nodes)
        latencies: list[float] = []

        def timed(ids):
            started = time.monotonic()
            try:
                return send(ids)
            finally:
                latencies.append(time.monotonic() - started)

        with NonStopClient(timed, [PROMPT]) as client:
            client.wait_for_results(2)
            removed_wall = time.time()
            cluster.remove_node(victim, allow_graceful=False)  # as the drill does: no goodbye to the GCS
            watch = mesh.router.node_watch
            wait_for(lambda: watch.detections, 30, "the router's node watch sees the node dead", every=0.05)
            router_detect_s = watch.detections[0]["t"] - removed_wall
            # Every lost actor handed over; usually in that first poll, but one the watch had not located yet (Ray
            # still creating it on a loaded box) is found in a later one (router_service/node_watch.py actor_node).
            # Or the router dropped it first: its failed calls had it marked dead and taken out of the transport's
            # map (or the reviver already swapped in the restored incarnation) before the watch's poll, so there was
            # nothing left to hand over (a CI run: the watch handed over 1 of 4 lost actors, 14 s after start).
            def dropped() -> set[str]:
                return {n for n in lost if getattr(transport.actors.get(n), "_actor_id", None) != lost_ids[n]}

            def handed_over() -> set[str]:
                seen = set().union(*(d["actors"] for d in watch.detections)) | dropped()
                return seen if seen >= set(lost) else set()

            seen = wait_for(handed_over, 30, "the router's node watch hands over every lost actor",
                            detail=lambda: (watch.detections, sorted(dropped())))
            assert set().union(*(d["actors"] for d in watch.detections)) <= set(lost) and seen == set(lost)
            wait_for(lambda: any(e["kind"] == "node_lost" for e in controller_state(mesh)["events"]), 30,
                     "the controller's node watch sees the node dead")
            events = controller_state(mesh)["events"]
            controller_detect_s = min(e["t"] for e in events if e["kind"] == "lost") - removed_wall
            # Each lost actor handled: restored, or (no GPU share free on the survivor, as here) re-planned: its
            # shards keep serving on their other replicas while Ray's autoscaler is asked for room.
            def handled() -> list[dict] | None:
                events = controller_state(mesh)["events"]
                done = {a for e in events if e["kind"] in ("restored", "restore_replanned")
                        for a in e["actor"].split(",")}
                return events if set(lost) <= done else None

            events = wait_for(handled, 120, "the lost actors restored or re-planned",
                              detail=lambda: controller_state(mesh)["events"])
            restore_s = max(e["t"] for e in events if e["kind"] in ("restored", "restore_replanned")) - removed_wall
            client.wait_for_results(2, timeout=120)
        assert not client.errors, client.errors[:3]
        assert client.results and all(tokens == fault_free for tokens in client.results)
        assert sorted(e["actor"] for e in events if e["kind"] == "lost") == lost
        node_lost = [e for e in events if e["kind"] == "node_lost"]
        assert [e["actor"] for e in node_lost] == [victim.node_id] and set(node_lost[0]["actors"]) <= set(lost)
        assert not [e for e in events if e["kind"] == "restore_failed"], events
        retried = mesh.backend.retried_calls
    print(f"node loss: router saw it after {router_detect_s:.2f} s, controller after {controller_detect_s:.2f} s, "
          f"restored or re-planned after {restore_s:.2f} s; slowest request {max(latencies):.2f} s; "
          f"{retried} calls retried; re-plans: "
          f"{[e['actor'] for e in events if e['kind'] == 'restore_replanned']}")
    assert router_detect_s < DETECT_S and controller_detect_s < DETECT_S
