"""Two `expertmesh serve`s shared by the integration modules that only need *a* running server. SHARED: the tiny
Mixtral
(issue 25: tests that boot less). Started on first use, stopped right after the last test that uses it (not at the
end of the session: an idle Ray would take CPU from every module after it on the 2-core CI machine), and the
modules that use it run one after another (tests/session_groups.py).

Its settings are the union of what its users need: an admin token (test_admin_served.py's destructive calls) and a
2 s wait for a drained expert. A module that changes the server (drains, kills) restores it before it ends
(`wait_until_restored`), so the next user meets every replica alive, undrained and SERVING.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.ops.server_process import ServerProcess
from expertmesh.protos import admin_pb2, admin_pb2_grpc
from expertmesh.router_service.admin_auth import ADMIN_TOKEN_KEY
from tests.served import ONE_ACTOR, start_server
from tests.traffic import wait_for

ADMIN_TOKEN = "adm1n-s3cret"
ADMIN = ((ADMIN_TOKEN_KEY, ADMIN_TOKEN),)
WAIT_TIMEOUT_S = 2  # a request for a drained expert fails after this (the default 30 s would only slow tests)
RESTORE_S = 120


class SharedServer:
    """A server, started lazily with `args` and stopped once (by the last user's teardown or the session's end)."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.server: ServerProcess | None = None

    def get(self, *more_args: str) -> ServerProcess:
        if self.server is None:
            self.server = start_server(*self.args, *more_args)
        return self.server

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            assert server.stop() == 0, server.log()


SHARED = SharedServer("--admin-token", ADMIN_TOKEN, "--wait-timeout", str(WAIT_TIMEOUT_S))  # + --model <tiny Mixtral>
# The embedded model with every setting at its default (16 MiB messages, no token) and the OpenAI front on a free
# port, one actor: the OpenAI parameter tests and the hostile-client tests only read from it (each started its own
# until CI went over its 45-minute bound; a server start is 30-50 s there).
SHARED_HTTP = SharedServer("--http-port", "0", *ONE_ACTOR)


def wait_until_restored(target: str) -> None:
    """Undrain what is drained and wait until every replica is alive, not restoring, and health is SERVING."""
    with grpc.insecure_channel(target) as chan:
        admin = admin_pb2_grpc.AdminStub(chan)
        for r in admin.GetClusterState(admin_pb2.ClusterStateRequest(), timeout=30).replicas:
            if r.drained:
                admin.UndrainReplica(admin_pb2.ReplicaRequest(actor=r.actor), metadata=ADMIN, timeout=300)

        def restored() -> bool:
            state = admin.GetClusterState(admin_pb2.ClusterStateRequest(), timeout=30)
            health = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=15).status
            return (all(r.alive and not r.drained and not r.restoring for r in state.replicas)
                    and health == health_pb2.HealthCheckResponse.SERVING)

        wait_for(restored, RESTORE_S, "the shared server restored", every=0.5, ignore=(grpc.RpcError,))
