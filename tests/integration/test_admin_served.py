"""Destructive Admin calls and health through the real gRPC front (the session's shared `expertmesh serve`
subprocess, tests/shared_server.py, restored when this module ends), with an admin token and the default layout
(one replica per expert, so every replica is the last live one of its shards):

- without the admin token (or with a wrong one) Kill/Drain/UndrainReplica are refused PERMISSION_DENIED and the
  service keeps serving;
- with it, draining or killing the last live replica is refused FAILED_PRECONDITION naming the shards, unless forced;
- a forced drain turns health NOT_SERVING and requests for that expert fail UNAVAILABLE (after the shared server's
  short wait timeout); UndrainReplica brings it back: SERVING again and the same answers as before;
- Health.Watch streams each change; a forced kill is NOT_SERVING until the controller restored the replica.

A server without any admin token refusing them is in test_grpc_serve.py (its server has none), and behind Serve's
own gRPC proxy in test_serve_config.py.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.protos import admin_pb2, admin_pb2_grpc
from expertmesh.router_service.admin_auth import ADMIN_TOKEN_KEY
from tests.served import generate_ids
from tests.shared_server import ADMIN, ADMIN_TOKEN, wait_until_restored
from tests.traffic import wait_for

ACTOR = "expert-e0-r0"  # hosts expert 0 of both MoE layers of the tiny Mixtral, its only replica
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]  # long enough that expert 0 gets tokens in every layer
MAX_TOKENS = 4
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Restores and undrains start a process that imports torch; generous on a loaded 2-core machine.
BACK_S = 90


@pytest.fixture(scope="module")
def served(shared_server):
    """The session's shared server (its admin token is this module's); left as found: every replica alive,
    undrained, SERVING."""
    yield shared_server
    wait_until_restored(shared_server.target)


@pytest.fixture(scope="module")
def generation_before(channel) -> int:
    return replica(channel).generation


def generate(chan, timeout: float = 60) -> list[int]:
    return generate_ids(chan, PROMPT, MAX_TOKENS, timeout)


def health(chan) -> int:
    return health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=15).status


def replica(chan, actor: str = ACTOR) -> admin_pb2.ReplicaState:
    state = admin_pb2_grpc.AdminStub(chan).GetClusterState(admin_pb2.ClusterStateRequest(), timeout=30)
    return {r.actor: r for r in state.replicas}[actor]


def admin_call(chan, method: str, force: bool = False, metadata=ADMIN) -> admin_pb2.ReplicaReply:
    stub = admin_pb2_grpc.AdminStub(chan)
    return getattr(stub, method)(admin_pb2.ReplicaRequest(actor=ACTOR, force=force), metadata=metadata, timeout=300)


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


class Watcher:
    """Health.Watch on a thread: every status the server streams, until the `with` block ends (then cancelled)."""

    def __init__(self, chan):
        self.statuses: list[int] = []
        self.error: BaseException | None = None
        self._call = health_pb2_grpc.HealthStub(chan).Watch(health_pb2.HealthCheckRequest(), timeout=600)
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        try:
            for message in self._call:
                self.statuses.append(message.status)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = exc

    def __enter__(self) -> Watcher:
        self._thread.start()
        wait_for(lambda: self.statuses or self.error, 30, "Watch's first message")
        return self

    def __exit__(self, *exc) -> None:
        self._call.cancel()
        self._thread.join(30)


@pytest.fixture(scope="module")
def expected(channel) -> list[int]:
    return generate(channel)


@pytest.mark.parametrize("method", ["KillReplica", "DrainReplica", "UndrainReplica"])
@pytest.mark.parametrize("metadata", [(), ((ADMIN_TOKEN_KEY, "wrong"),), (("authorization", f"Bearer {ADMIN_TOKEN}"),)])
def test_destructive_calls_without_the_admin_token_are_refused_and_change_nothing(channel, expected, method,
                                                                                 metadata, generation_before):
    error = refused(lambda: admin_call(channel, method, force=True, metadata=metadata))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and ADMIN_TOKEN_KEY in error.details()
    state = replica(channel)
    assert state.alive and not state.drained and state.generation == generation_before
    assert health(channel) == SERVING and generate(channel) == expected


@pytest.mark.parametrize("method", ["KillReplica", "DrainReplica"])
def test_the_last_live_replica_is_not_taken_out_without_force(channel, expected, method, generation_before):
    error = refused(lambda: admin_call(channel, method))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "(layer 0, expert 0)" in error.details() and "(layer 1, expert 0)" in error.details(), error.details()
    assert "force" in error.details()
    state = replica(channel)
    assert state.alive and not state.drained and state.generation == generation_before
    assert health(channel) == SERVING and generate(channel) == expected


def test_undrain_of_a_replica_that_is_not_drained_is_refused(channel):
    error = refused(lambda: admin_call(channel, "UndrainReplica"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "not drained" in error.details()


def test_forced_drain_is_not_serving_until_undrained_and_watch_streams_each_change(channel, expected):
    with Watcher(channel) as watch:
        assert watch.statuses == [SERVING]
        assert admin_call(channel, "DrainReplica", force=True).ok
        wait_for(lambda: health(channel) == NOT_SERVING, 30, "health NOT_SERVING after the forced drain")

        def fails_unavailable() -> bool:
            try:
                generate(channel)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                return "no live replica" in exc.details()
            return False  # the router had not switched to the drained table yet

        wait_for(fails_unavailable, 60, "requests for the drained expert failing", every=0.5)
        state = replica(channel)
        assert state.drained
        wait_for(lambda: watch.statuses[-1:] == [NOT_SERVING], 30, "Watch streaming NOT_SERVING")

        reply = admin_call(channel, "UndrainReplica")
        assert reply.ok, reply.message
        wait_for(lambda: health(channel) == SERVING, BACK_S, "health SERVING after the undrain")
        assert generate(channel) == expected  # the router routes to it again: the same answer as before
        wait_for(lambda: watch.statuses[-1:] == [SERVING], 30, "Watch streaming SERVING again")
    assert watch.error is None, watch.error
    assert watch.statuses == [SERVING, NOT_SERVING, SERVING]  # one message per change, no repeats
    state = replica(channel)
    assert state.alive and not state.drained
    kinds = [e.kind for e in admin_pb2_grpc.AdminStub(channel).GetClusterState(
        admin_pb2.ClusterStateRequest(), timeout=30).events if e.actor == ACTOR]
    assert "draining" in kinds and kinds[-1] == "undrained", kinds


def test_forced_kill_of_the_last_replica_is_not_serving_until_it_is_restored(channel, expected):
    generation = replica(channel).generation
    with Watcher(channel) as watch:
        assert admin_call(channel, "KillReplica", force=True).ok
        wait_for(lambda: replica(channel).generation > generation and replica(channel).alive, BACK_S,
                 f"{ACTOR} restored", every=0.5)
        wait_for(lambda: health(channel) == SERVING, 30, "health SERVING after the restore")
        assert generate(channel) == expected
        wait_for(lambda: watch.statuses[-1:] == [SERVING], 30, "Watch streaming SERVING again")
    assert watch.error is None, watch.error
    assert watch.statuses[0] == SERVING and NOT_SERVING in watch.statuses and watch.statuses[-1] == SERVING


def test_health_of_an_unknown_service_is_not_found(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    error = refused(lambda: stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    watch = stub.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    watch.cancel()
    assert stub.Check(health_pb2.HealthCheckRequest(service="expertmesh.v1.Inference"), timeout=10).status == SERVING


@pytest.mark.parametrize("method", ["KillReplica", "DrainReplica", "UndrainReplica"])
def test_a_huge_actor_name_is_not_found_without_being_echoed_whole(channel, method):
    """Issue 18 item 7 for Admin: a 1 MB actor name gets NOT_FOUND with a short message (not a metadata-size
    RESOURCE_EXHAUSTED), and nothing changes."""
    stub = admin_pb2_grpc.AdminStub(channel)
    err = refused(lambda: getattr(stub, method)(admin_pb2.ReplicaRequest(actor="x" * 1_000_000), metadata=ADMIN,
                                                timeout=60))
    assert err.code() == grpc.StatusCode.NOT_FOUND and len(err.details()) < 300, err.details()[:300]
    assert replica(channel).alive and health(channel) == SERVING
