"""Failover across nodes and in the served deployment: a whole (fake) node removed under an ExpertMesh, the
controller killed while requests flow, an expert killed through the Admin API, and the router replica killed.

Two Rays, one after the other: a `ray.cluster_utils.Cluster` that lives inside the node-loss test only, then one
local Ray for the module's served tests, which `expertmesh serve` (a subprocess) joins by address, so this process
can kill the actors it serves with.
"""

from __future__ import annotations

import time

import pytest
import ray
from ray._private import state as ray_state

from expertmesh.cluster.naming import CONTROLLER_NAME, NAMESPACE
from expertmesh.experts.reference import load_reference_model
from expertmesh.protos import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from expertmesh.protos import inference_pb2 as pb
from expertmesh.router_service.admin_auth import admin_metadata
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from tests.clusters import FAKE_GPUS, start_cluster
from tests.served import generate_ids, router_replicas, server_on_own_ray
from tests.tiny_checkpoints import greedy_tokens
from tests.traffic import NonStopClient, StreamsInFlight, wait_for

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
MAX_TOKENS = 6
# Deadlines. Typical on an idle 2-core machine: node restore ~5 s, expert restore ~4 s, controller back ~3 s, router
# replica back ~12 s. A restore starts a process that imports torch, hence the margin on a loaded machine.
RESTORE_S = 30
CONTROLLER_BACK_S = 15
ROUTER_BACK_S = 30
ADMIN_TOKEN = "failover-admin"  # KillReplica through the Admin API needs it


@pytest.fixture(scope="module")
def expected(checkpoints) -> list[int]:
    return greedy_tokens(load_reference_model(checkpoints["mixtral"]), PROMPT, MAX_TOKENS)


def actor_info(name: str, timeout: float = 5) -> dict:
    return ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote(), timeout=timeout)


# ---- a whole node lost ---------------------------------------------------------------------------------------------


@pytest.fixture
def gpu_cluster():
    """Head without GPUs + two workers declaring 2 GPUs each (no real GPU needed); only for the test using it."""
    cluster, workers = start_cluster({"num_cpus": 1, "num_gpus": 0, "include_dashboard": False},
                                     [{"num_cpus": 2, "num_gpus": 2}] * 2)
    ray.init(address=cluster.address, namespace=NAMESPACE)
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def test_node_lost_output_unchanged_and_replicas_restored_elsewhere(gpu_cluster, checkpoints, expected):
    cluster, workers = gpu_cluster
    experts = {"replicas_per_expert": 2, "layout": "per-expert"}
    with ExpertMesh(MeshConfig.from_dict({"model": {"path": str(checkpoints["mixtral"])}, "experts": experts,
                                          "devices": FAKE_GPUS})) as mesh:
        slots = {s.name: s for s in mesh.slots}
        for expert in range(4):  # replicas of one expert on different nodes, both workers
            nodes = {slots[f"expert-e{expert}-r{r}"].node_id for r in range(2)}
            assert nodes <= {w.node_id for w in workers} and len(nodes) == 2
        before = mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS)
        assert before.token_ids == expected

        # Both workers are full (4 actors x 0.5 GPU on 2 GPUs each), so the lost replicas need a node with room:
        # a spare worker joins first, as an autoscaler would provide one.
        spare = cluster.add_node(num_cpus=2, num_gpus=2)
        cluster.wait_for_nodes()
        # Remove a worker that does not host the controller: a controller that Ray restarts elsewhere never watches
        # again under ExpertMesh (see the xfail in test_failover.py), and Ray places it (num_cpus=0) at random.
        controller_node = ray_state.actors(actor_id=mesh.controller._actor_id.hex())["Address"]["NodeID"]
        victim = next(w for w in workers if w.node_id != controller_node)
        survivor = next(w for w in workers if w is not victim)
        lost = sorted(name for name, slot in slots.items() if slot.node_id == victim.node_id)
        assert len(lost) == 4
        cluster.remove_node(victim)
        after = mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS)
        assert after.token_ids == expected
        # Either a call to a lost actor failed and its rows were re-sent, or (on a loaded machine, when Ray takes
        # longer to remove the node than the router's 0.5 s node poll) the node watch marked them dead first.
        assert mesh.backend.retried_calls + mesh.backend.node_lost_actors > 0
        assert mesh.backend.degraded_slots == 0

        started = time.monotonic()

        def restored() -> dict[str, dict] | None:
            infos = {name: actor_info(name) for name in lost}
            return infos if all(i["generation"] == 1 for i in infos.values()) else None

        infos = wait_for(restored, RESTORE_S, "lost replicas restored", every=0.25, ignore=(Exception,),
                         detail=lambda: ray.get(mesh.controller.get_state.remote())["events"])
        restore_s = time.monotonic() - started
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert victim.node_id not in alive
        for name, info in infos.items():
            # The least-loaded live GPU node: the spare (the survivor keeps its own four replicas).
            assert info["node_id"] == spare.node_id, (name, info["node_id"])
        survivors = {info["name"]: info for info in (actor_info(name) for name in slots if name not in lost)}
        assert all(i["node_id"] == survivor.node_id and i["generation"] == 0 for i in survivors.values())
        # A restored actor answers info() a moment before the controller's await of it returns and logs "restored"
        # (a fresh-clone run read the events in between: 3 of 4), so wait for the controller's own account.
        def restored_events() -> dict | None:
            state = ray.get(mesh.controller.get_state.remote())
            done = {e["actor"] for e in state["events"] if e["kind"] == "restored"}
            return state if done >= set(lost) else None

        state = wait_for(restored_events, 30, "the controller's restored events",
                         detail=lambda: ray.get(mesh.controller.get_state.remote())["events"])
        assert {e["actor"] for e in state["events"] if e["kind"] == "restored"} == set(lost)
        assert state["epoch"] == len(lost)

        # The router finds the restored replicas by name and uses them again.
        def back_in_use() -> bool:
            assert mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids == expected
            return not mesh.backend.dead

        wait_for(back_in_use, 30, "router using the restored replicas", every=0.25, ignore=(Exception,))

        # The router may have taken them back at the last layer of that request, so they may not have served yet;
        # the next requests plan with them (each generate is checked against the reference as it goes).
        def restored_serve() -> bool:
            assert mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids == expected
            return sum(actor_info(name)["calls"] for name in lost) > 0

        wait_for(restored_serve, 30, "restored replicas serving calls", every=0.25, ignore=(Exception,))
    print(f"restored {len(lost)} replicas in {restore_s:.1f}s")


# ---- served: controller, expert and router replica killed --------------------------------------------------------


@pytest.fixture(scope="module")
def served(checkpoints):
    with server_on_own_ray("--model", str(checkpoints["mixtral"]), "--replicas-per-expert", "2",
                           "--admin-token", ADMIN_TOKEN) as server:
        yield server


def generate(chan, timeout: float = 60) -> list[int]:
    return generate_ids(chan, PROMPT, MAX_TOKENS, timeout)


def cluster_state(chan) -> admin_pb2.ClusterState:
    return admin_pb2_grpc.AdminStub(chan).GetClusterState(admin_pb2.ClusterStateRequest(), timeout=30)


def test_controller_killed_mid_traffic_comes_back_with_the_same_state(channel, expected):
    state = cluster_state(channel)
    assert state.controller_alive and len(state.replicas) == 8
    placement = {r.actor: r.node_id for r in state.replicas}
    assert all(placement.values())
    epoch = state.epoch
    old = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)

    with NonStopClient(lambda _prompt: generate(channel), [PROMPT]) as traffic:
        traffic.wait_for_results(1)
        ray.kill(old)  # no_restart: the server's supervisor, not Ray, has to bring it back

        def gone() -> bool:
            try:
                ray.get(old.get_state.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                return True
            return False

        wait_for(gone, 30, "old controller gone", every=0.25, ignore=(Exception,))
        killed_at = time.monotonic()

        def back() -> admin_pb2.ClusterState | None:
            new = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
            if new._actor_id == old._actor_id:
                return None
            got = cluster_state(channel)
            return got if got.controller_alive else None

        state = wait_for(back, CONTROLLER_BACK_S, "controller alive again", every=0.25, ignore=(Exception,))
        print(f"controller back after {time.monotonic() - killed_at:.1f}s")
        assert {r.actor: r.node_id for r in state.replicas} == placement
        assert state.epoch == epoch
        traffic.wait_for_results(1)

        # An expert killed through the Admin API is restored by the new controller while requests keep flowing.
        # Not forced: expert-e0-r1 still serves expert 0.
        reply = admin_pb2_grpc.AdminStub(channel).KillReplica(admin_pb2.ReplicaRequest(actor="expert-e0-r0"),
                                                              metadata=admin_metadata(ADMIN_TOKEN), timeout=30)
        assert reply.ok, reply.message
        killed_at = time.monotonic()

        def restored() -> bool:
            got = {r.actor: r for r in cluster_state(channel).replicas}["expert-e0-r0"]
            return got.alive and got.generation == 1

        wait_for(restored, RESTORE_S, "expert-e0-r0 restored", every=0.25, ignore=(Exception,))
        print(f"expert-e0-r0 restored after {time.monotonic() - killed_at:.1f}s")
        assert actor_info("expert-e0-r0")["generation"] == 1
        traffic.wait_for_results(2)

    assert not traffic.errors, traffic.errors[:3]
    assert traffic.results and all(ids == expected for ids in traffic.results)
    state = cluster_state(channel)
    assert state.epoch == epoch + 1 and state.controller_alive
    assert {r.actor: r.node_id for r in state.replicas} == placement
    kinds = [(e.kind, e.actor) for e in state.events]
    assert ("killed", "expert-e0-r0") in kinds and ("restored", "expert-e0-r0") in kinds
    assert state.router.retried_calls > 0  # the router re-sent the killed replica's tokens to its peer


LONG_TOKENS = 60  # streams long enough to be mid-way when the replica dies
LONG_SAMPLING = [dict(), dict(temperature=0.9, top_k=20, seed=11)]


def long_requests() -> list[pb.GenerateRequest]:
    return [pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_tokens=LONG_TOKENS, ignore_eos=True, **s)
            for s in LONG_SAMPLING]


def stream_tokens(chan, request: pb.GenerateRequest, timeout: float = 120) -> list[int]:
    stub = inference_pb2_grpc.InferenceStub(chan)
    return [t for m in stub.Generate(request, timeout=timeout) if m.HasField("token") for t in m.token.token_ids]


def test_router_replica_killed_is_replaced(served, channel, expected):
    """The only router replica killed under live streams (issue 18 item 11): Serve restarts it, the front holds
    the in-flight streams and the new requests until it is back and resumes them there; not one request fails and
    every output equals the fault-free one."""
    assert generate(channel) == expected
    fault_free = [stream_tokens(channel, r) for r in long_requests()]
    replicas = router_replicas()
    assert len(replicas) == 1, replicas
    streams = StreamsInFlight(inference_pb2_grpc.InferenceStub(channel), long_requests())
    wait_for(streams.all_started, 60, "every stream mid-way", detail=lambda: streams.errors)
    name, namespace = replicas[0]
    ray.kill(ray.get_actor(name, namespace=namespace))
    killed_at = time.monotonic()
    # From the kill on, no failure is acceptable: a new request waits for the restarted replica.
    assert generate(channel, timeout=ROUTER_BACK_S + 60) == expected
    print(f"router serving again after {time.monotonic() - killed_at:.1f}s")
    assert streams.join() == fault_free and streams.errors == [None, None], streams.errors
    assert "router replica lost mid-stream" in served.log(chars=200_000)
    for _ in range(3):
        assert generate(channel) == expected

    def replaced() -> bool:
        now = router_replicas()
        return len(now) == 1 and now[0][0] != name

    wait_for(replaced, 10, "one new router replica", every=0.25, ignore=(Exception,))
