"""Health.Watch's stream (router_service/health.py): the status at once, then one message per change, never a
repeat; an unknown service gets SERVICE_UNKNOWN and the call stays open."""

from __future__ import annotations

import asyncio

from expertmesh.router_service import health


def collect(service: str, statuses: list[int], count: int, timeout: float = 5.0) -> list[int]:
    """The first `count` statuses Watch streams while the verdict runs through `statuses` (then stays at the last)."""
    calls = iter(statuses)
    last = statuses[-1]

    async def check() -> int:
        return next(calls, last)

    async def run() -> list[int]:
        got: list[int] = []
        stream = health.watch(service, check, every_s=0.001)
        async for message in stream:
            got.append(message.status)
            if len(got) == count:
                break
        await stream.aclose()
        return got

    return asyncio.run(asyncio.wait_for(run(), timeout))


def test_watch_sends_the_current_status_then_only_changes():
    s, n = health.SERVING, health.NOT_SERVING
    assert collect("", [s, s, s, n, n, s, s, n], 4) == [s, n, s, n]


def test_watch_of_a_known_service_by_name_follows_the_server():
    assert collect("expertmesh.v1.Inference", [health.NOT_SERVING], 1) == [health.NOT_SERVING]


def test_watch_of_an_unknown_service_says_so_and_keeps_the_call_open():
    async def run() -> tuple[int, bool]:
        stream = health.watch("no.such.Service", lambda: None)  # never asked: the service does not exist
        first = await stream.__anext__()
        try:
            await asyncio.wait_for(stream.__anext__(), 0.2)
            still_open = False
        except asyncio.TimeoutError:
            still_open = True
        return first.status, still_open

    status, still_open = asyncio.run(run())
    assert status == health.SERVICE_UNKNOWN and still_open


def test_known_services_are_the_server_and_what_it_serves():
    assert health.known_service("") and health.known_service("inference.GRPCInferenceService")
    assert not health.known_service("grpc.health.v1.Health.nope")
