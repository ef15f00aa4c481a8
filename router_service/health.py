"""grpc.health.v1 as expertmesh answers it, shared by the gRPC front and the deployment (behind Serve's own proxy).

The verdict itself is cluster/shard_liveness.py:health_verdict (the deployment computes it from its routing table,
the controller's drained/down sets and the no-replica policy). Here: which service names exist, and Watch, which
streams the status now and then one message each time it changes (the health protocol's semantics), polling the
verdict every `WATCH_POLL_S`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from grpc_health.v1 import health_pb2

# "" is the whole server; the others are the services it serves (a client may ask about one by name).
SERVICES = ("", "expertmesh.v1.Inference", "expertmesh.v1.Admin", "inference.GRPCInferenceService")
WATCH_POLL_S = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def known_service(service: str) -> bool:
    return service in SERVICES


def response(status: int) -> health_pb2.HealthCheckResponse:
    return health_pb2.HealthCheckResponse(status=status)


async def watch(service: str, check: Callable[[], Awaitable[int]],
                every_s: float = WATCH_POLL_S) -> AsyncIterator[health_pb2.HealthCheckResponse]:
    """The Watch stream: the current status at once, then a message whenever it changes; runs until the client
    goes away (its cancel ends the generator). An unknown service gets SERVICE_UNKNOWN and the call stays open,
    as the protocol asks (the service may appear later; ours never do)."""
    if not known_service(service):
        yield response(SERVICE_UNKNOWN)
        while True:
            await asyncio.sleep(3600)
    last = None
    while True:
        status = await check()
        if status != last:
            yield response(status)
            last = status
        await asyncio.sleep(every_s)
