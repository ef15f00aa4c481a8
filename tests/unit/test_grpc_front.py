"""The gRPC front's streaming relay in-process, against a fake router handle (no Ray is started): every stream a
client cancels right after its first token cancels its router call, wherever the cancel lands (issue 18 item 5);
a stream that ends is not cancelled; a router error reaches the client with its code. A stream whose router replica
dies resumes after the tokens it delivered, each token reaching the client once (issue 18 item 11)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from ray.exceptions import ActorUnavailableError

from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc
from expertmesh.router_service.config import ServerConfig
from expertmesh.router_service.grpc_front import MAX_RESUMES, start_front
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


# ---- a router replica dies under a stream (issue 18 item 11) -------------------------------------------------------


class DyingReplicas:
    """A handle whose n-th Generate call streams tokens 1..total continuing after the request's resume_token_ids,
    and dies (ActorUnavailableError, what Ray 2.60 raises for a replica killed mid-stream) after `dies_after[n]` of
    them (None: lives to the end, then sends the done message)."""

    def __init__(self, total: int, dies_after: list[int | None]):
        self.total = total
        self.dies_after = dies_after
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled: list[bool] = []

    def options(self, **_) -> DyingReplicas:
        return self

    @property
    def Generate(self) -> DyingReplicas:  # noqa: N802
        return self

    def remote(self, request, **_):
        self.requests.append(request)
        self.cancelled.append(False)
        return self._stream(len(self.requests) - 1, request)

    def _stream(self, call: int, request):
        handle = self

        class Stream:
            def cancel(self) -> None:
                handle.cancelled[call] = True

            async def _messages(self):
                start = len(request.resume_token_ids)
                dies = handle.dies_after[call] if call < len(handle.dies_after) else None
                for sent, token in enumerate(range(start + 1, handle.total + 1)):
                    if dies is not None and sent == dies:
                        raise ActorUnavailableError("Actor is unavailable.", None)
                    await asyncio.sleep(0)
                    yield pb.GenerateResponse(token=pb.TokenChunk(token_ids=[token]))
                if dies is not None:
                    raise ActorUnavailableError("Actor is unavailable.", None)
                yield pb.GenerateResponse(done=pb.GenerationDone(
                    finish_reason="length", usage=pb.Usage(prompt_tokens=2, completion_tokens=handle.total)))

            def __aiter__(self):
                return self._messages()

        return Stream()


async def read_all(stub) -> tuple[list[int], pb.GenerationDone]:
    tokens, done = [], None
    async for message in stub.Generate(REQUEST, timeout=30):
        if message.HasField("token"):
            tokens.extend(message.token.token_ids)
        else:
            done = message.done
    return tokens, done


def test_a_stream_whose_replica_dies_resumes_after_the_delivered_tokens_each_token_once():
    handle = DyingReplicas(total=9, dies_after=[3, 2])  # two replicas die under it, the third finishes
    tokens, done = run_against_front(handle, read_all)
    assert tokens == list(range(1, 10)) and done.usage.completion_tokens == 9
    assert [list(r.resume_token_ids) for r in handle.requests] == [[], [1, 2, 3], [1, 2, 3, 4, 5]]
    for resumed in handle.requests[1:]:  # otherwise the same request
        again = pb.GenerateRequest()
        again.CopyFrom(resumed)
        again.ClearField("resume_token_ids")
        assert again == REQUEST
    assert handle.cancelled == [True, True, False]  # the failed calls are let go of


def test_a_request_whose_replica_is_dead_before_any_token_is_resent_unchanged():
    handle = DyingReplicas(total=4, dies_after=[0])
    tokens, _ = run_against_front(handle, read_all)
    assert tokens == [1, 2, 3, 4] and handle.requests == [REQUEST, REQUEST]


def test_a_replica_lost_after_every_token_resumes_for_the_done_message_alone():
    handle = DyingReplicas(total=3, dies_after=[3])
    tokens, done = run_against_front(handle, read_all)
    assert tokens == [1, 2, 3] and done.finish_reason == "length"
    assert list(handle.requests[1].resume_token_ids) == [1, 2, 3]


def test_resuming_is_bounded_then_the_client_gets_unavailable():
    handle = DyingReplicas(total=50, dies_after=[1] * (MAX_RESUMES + 1))  # progress each time: no time limit

    async def client(stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_all(stub)
        return err.value

    error = run_against_front(handle, client)
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "ActorUnavailableError" in error.details()
    assert len(handle.requests) == MAX_RESUMES + 1


def test_a_request_error_is_not_retried():
    handle = FakeHandle(tokens=2, fail=ApiError("UNAVAILABLE", "an expert actor is unavailable: ActorDiedError"))

    async def client(stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_all(stub)
        return err.value

    assert run_against_front(handle, client).code() == grpc.StatusCode.UNAVAILABLE
    assert len(handle.calls) == 1  # the deployment's own answer (an ApiError), even UNAVAILABLE, is final


def test_failing_in_a_row_without_progress_gives_up_after_the_resume_window(monkeypatch):
    from expertmesh.router_service import grpc_front

    monkeypatch.setattr(grpc_front, "RESUME_WAIT_S", 0.5)
    handle = DyingReplicas(total=5, dies_after=[0] * (MAX_RESUMES + 1))  # no replica ever answers

    async def client(stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_all(stub)
        return err.value

    assert run_against_front(handle, client).code() == grpc.StatusCode.UNAVAILABLE
    assert 3 <= len(handle.requests) <= 6  # backoff 0.1, 0.2, 0.4, ... until 0.5 s have passed


class FakeUnary:
    """A Serve unary call (DeploymentResponse): awaitable, never done unless `result` is set; records cancel()."""

    def __init__(self, result=None):
        self.result = result
        self.cancelled = False

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self):
        if self.result is None:
            await asyncio.Event().wait()  # a long Score: only a cancel ends it
        return self.result

    def cancel(self) -> None:
        self.cancelled = True


class FakeScoreHandle:
    def __init__(self, result=None):
        self.result = result
        self.calls: list[FakeUnary] = []

    def options(self, **_) -> FakeScoreHandle:
        return self

    @property
    def Score(self) -> FakeScoreHandle:  # noqa: N802
        return self

    def remote(self, request, **_) -> FakeUnary:
        self.calls.append(FakeUnary(self.result))
        return self.calls[-1]


def test_a_unary_call_the_client_cancels_or_lets_expire_is_cancelled_at_the_router():
    """Serve leaves a unary call running on the replica when the awaiting front handler is cancelled; the front
    cancels it (router_service/serve_calls.py), so a long Score stops with its client."""
    handle = FakeScoreHandle()

    async def client(stub):
        call = stub.Score(pb.ScoreRequest(token_ids=[1, 2]), timeout=30)
        await poll(lambda: len(handle.calls) == 1, timeout=5)
        call.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # and one whose deadline passes
            await stub.Score(pb.ScoreRequest(token_ids=[1, 2]), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return await poll(lambda: len(handle.calls) == 2 and all(c.cancelled for c in handle.calls), timeout=5)

    assert run_against_front(handle, client), [c.cancelled for c in handle.calls]


def test_a_unary_call_that_completes_is_not_cancelled():
    handle = FakeScoreHandle(result=pb.ScoreResponse())

    async def client(stub):
        return await stub.Score(pb.ScoreRequest(token_ids=[1, 2]), timeout=30)

    assert run_against_front(handle, client) == pb.ScoreResponse()
    assert not handle.calls[0].cancelled


class DyingScoreReplicas:
    """Score calls: the first `deaths` die with their replica (ActorDiedError), then one answers."""

    def __init__(self, deaths: int, error: BaseException | None = None):
        self.deaths, self.error, self.calls = deaths, error, 0

    def options(self, **_):
        return self

    @property
    def Score(self):  # noqa: N802
        return self

    def remote(self, request):
        async def reply():
            self.calls += 1
            if self.error is not None:
                raise self.error
            if self.calls <= self.deaths:
                from ray.exceptions import ActorDiedError

                raise ActorDiedError()
            return pb.ScoreResponse()
        return reply()


def test_a_unary_call_whose_replica_dies_is_retried_on_a_live_one():
    handle = DyingScoreReplicas(deaths=2)

    async def client(stub):
        return await stub.Score(pb.ScoreRequest(token_ids=[1, 2]), timeout=30)

    assert isinstance(run_against_front(handle, client), pb.ScoreResponse) and handle.calls == 3


def test_a_unary_request_error_is_not_retried():
    handle = DyingScoreReplicas(deaths=0, error=ApiError("INVALID_ARGUMENT", "token_ids: empty"))

    async def client(stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Score(pb.ScoreRequest(), timeout=30)
        return err.value

    assert run_against_front(handle, client).code() == grpc.StatusCode.INVALID_ARGUMENT and handle.calls == 1
