"""The gRPC front's streaming relay in-process, against a fake router handle (no Ray is started): every stream a
client cancels right after its first token cancels its router call, wherever the cancel lands (issue 18 item 5);
a stream that ends is not cancelled; a router error reaches the client with its code."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc
from expertmesh.router_service.config import ServerConfig
from expertmesh.router_service.grpc_front import start_front
from expertmesh.router_service.proto_mapping import ApiError


class FakeStream:
    """What a Serve streaming call returns: an async iterator of messages that `cancel()` stops."""

    def __init__(self, tokens: int, fail: ApiError | None = None):
        self.tokens = tokens
        self.fail = fail
        self.sent = 0
        self.cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        if self.cancelled:
            raise asyncio.CancelledError
        if self.sent == self.tokens:
            if self.fail is not None:
                raise self.fail
            raise StopAsyncIteration
        await asyncio.sleep(0)  # a decoding step: hand the loop over
        self.sent += 1
        return pb.GenerateResponse(token=pb.TokenChunk(token_ids=[self.sent]))

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """A DeploymentHandle whose Generate calls are FakeStreams, each kept in `calls`."""

    def __init__(self, tokens: int, fail: ApiError | None = None):
        self.tokens = tokens
        self.fail = fail
        self.calls: list[FakeStream] = []

    def options(self, **_) -> FakeHandle:
        return self

    @property
    def Generate(self) -> FakeHandle:  # noqa: N802 (the proto method name)
        return self

    def remote(self, request, **_) -> FakeStream:
        self.calls.append(FakeStream(self.tokens, self.fail))
        return self.calls[-1]


def run_against_front(handle: FakeHandle, client) -> object:
    async def main():
        server, port = await start_front(handle, ServerConfig(port=0))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await client(inference_pb2_grpc.InferenceStub(channel))
        finally:
            await server.stop(None)

    return asyncio.run(main())


async def poll(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


REQUEST = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=100)


def test_every_cancel_right_after_the_first_token_cancels_the_router_call():
    handle = FakeHandle(tokens=10_000)  # far longer than the test: only a cancel ends one

    async def client(stub):
        async def cancel_after_first_token() -> None:
            call = stub.Generate(REQUEST, timeout=30)
            await call.read()
            call.cancel()

        for _ in range(10):  # 10 waves of 20 concurrent streams
            await asyncio.gather(*(cancel_after_first_token() for _ in range(20)))
        await poll(lambda: all(s.cancelled for s in handle.calls), timeout=5)

    run_against_front(handle, client)
    assert len(handle.calls) == 200
    lost = sum(not s.cancelled for s in handle.calls)
    assert lost == 0, f"{lost} of 200 streams the client cancelled still run at the router"


def test_a_stream_that_ends_is_relayed_whole_and_not_cancelled():
    handle = FakeHandle(tokens=7)

    async def client(stub):
        return [m.token.token_ids[0] async for m in stub.Generate(REQUEST, timeout=30)]

    assert run_against_front(handle, client) == [1, 2, 3, 4, 5, 6, 7]
    assert not handle.calls[0].cancelled


def test_a_router_error_mid_stream_reaches_the_client_with_its_code():
    handle = FakeHandle(tokens=2, fail=ApiError("INVALID_ARGUMENT", "max_tokens: too many"))

    async def client(stub):
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for message in stub.Generate(REQUEST, timeout=30):
                got.append(message.token.token_ids[0])
        return got, err.value

    got, error = run_against_front(handle, client)
    assert got == [1, 2]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details() == "max_tokens: too many"
