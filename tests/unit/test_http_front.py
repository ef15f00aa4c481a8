"""The HTTP front (router_service/http_front.py) against a fake router deployment handle, no Ray: SSE framing, errors
before and during a stream in OpenAI's shape, the bearer token, the body limit, and a client disconnect cancelling
the deployment call (which is what frees the sequence on the replica). Plus the server.http_port setting."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from expertmesh.protos import admin_pb2
from expertmesh.router_service.config import ConfigError, ServerConfig
from expertmesh.router_service.http_front import start_http_front
from expertmesh.router_service.proto_mapping import ApiError

MODEL = "m"
DONE = {"done": {"finish_reason": "length", "prompt_tokens": 2, "completion_tokens": 2,
                 "tokens_per_expert": {0: [1, 3]}, "rerouted": 0, "degraded": 0, "dropped": 0}}


def token(text: str) -> dict:
    return {"token": {"ids": [7], "text": text, "logprobs": None}}


class FakeCall:
    """A Serve streaming call: yields `events` (raising any exception among them), `delay` s apart."""

    def __init__(self, events: list, delay: float):
        self.events, self.delay = events, delay
        self.cancelled = False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for event in self.events:
            await asyncio.sleep(self.delay)
            if isinstance(event, BaseException):
                raise event
            yield event

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    def __init__(self, events: list, delay: float = 0.0):
        self.events, self.delay = events, delay
        self.calls: list[tuple[object, FakeCall]] = []

    def options(self, **_):
        return self

    @property
    def OpenAIGenerate(self):  # noqa: N802
        return self

    @property
    def GetClusterState(self):  # noqa: N802
        return _State()

    def remote(self, job):
        call = FakeCall(self.events, self.delay)
        self.calls.append((job, call))
        return call


class _State:
    def remote(self, request):
        async def reply():
            return admin_pb2.ClusterState(model=MODEL, epoch=3, load_json='{"layers": [0]}', control_json="[]",
                                          events=[admin_pb2.ClusterEvent(time=1.0, kind="lost", actor="e",
                                                                         detail_json='{"x": 1}')])
        return reply()


def run(handle: FakeHandle, check, **settings):
    """`check(session)` against the front as `expertmesh serve` starts it (start_http_front, a free port)."""
    async def main():
        runner, port = await start_http_front(handle, ServerConfig(http_port=0, **settings), MODEL)
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
                await check(client)
        finally:
            await runner.cleanup()

    asyncio.run(main())


BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}


def test_stream_is_server_sent_events_ending_in_done():
    async def check(client):
        reply = await client.post("/v1/completions", json=BODY)
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
        raw = await reply.text()
        frames = raw.split("\n\n")
        assert frames[-2:] == ["data: [DONE]", ""]
        chunks = [json.loads(f[len("data: "):]) for f in frames[:-2]]
        assert [c["choices"][0]["text"] for c in chunks[:2]] == ["a", "b"]
        assert chunks[2]["choices"][0]["finish_reason"] == "length" and chunks[3]["usage"]["total_tokens"] == 4

    run(FakeHandle([token("a"), token("b"), DONE]), check)


@pytest.mark.parametrize(("error", "status", "param"), [
    (ApiError("INVALID_ARGUMENT", "max_tokens: prompt + max_tokens exceed the context"), 400, "max_tokens"),
    (ApiError("RESOURCE_EXHAUSTED", "server busy: 3 waiting (max_waiting); retry later"), 429, None),
    (ApiError("UNAVAILABLE", "an expert actor is unavailable"), 503, None),
    (RuntimeError("boom\nTraceback (most recent call last)"), 503, None),
])
def test_an_error_before_the_first_token_is_a_status(error, status, param):
    handle = FakeHandle([error])

    async def check(client):
        for stream in (True, False):
            reply = await client.post("/v1/completions", json=BODY | {"stream": stream, "stream_options": None})
            body = await reply.json()
            assert reply.status == status and body["error"]["param"] == param
            assert "Traceback" not in body["error"]["message"]

    run(handle, check)
    assert all(call.cancelled for _, call in handle.calls)


def test_an_error_mid_stream_is_an_error_event():
    async def check(client):
        reply = await client.post("/v1/completions", json=BODY)
        frames = (await reply.text()).split("\n\n")
        assert json.loads(frames[1][6:])["error"]["code"] == "service_unavailable"
        assert frames[-2] == "data: [DONE]"

    run(FakeHandle([token("a"), ApiError("UNAVAILABLE", "gone")]), check)


def test_a_client_disconnect_cancels_the_deployment_call():
    handle = FakeHandle([token("x")] * 10_000, delay=0.01)

    async def check(client):
        reply = await client.post("/v1/completions", json=BODY)
        assert (await reply.content.readline()).startswith(b"data: ")
        reply.close()  # drop the connection mid-stream
        for _ in range(500):
            if handle.calls[0][1].cancelled:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the deployment call was not cancelled")

    run(handle, check)


def test_a_client_that_leaves_while_queued_cancels_the_call():
    """Nothing is written while the request waits for its first token: only handler cancellation notices."""
    handle = FakeHandle([token("x")], delay=60)

    async def check(client):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.post("/v1/completions", json=BODY), 0.3)
        for _ in range(300):
            if handle.calls and handle.calls[0][1].cancelled:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the queued request's deployment call was not cancelled")

    run(handle, check)


def test_token_body_limit_and_the_page():
    async def check(client):
        assert (await client.get("/v1/models")).status == 401
        assert (await client.get("/api/state")).status == 401
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status == 401 and (await wrong.json())["error"]["type"] == "authentication_error"
        auth = {"Authorization": "Bearer t0ken"}
        models = await (await client.get("/v1/models", headers=auth)).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        big = await client.post("/v1/completions", headers=auth, json={"model": MODEL, "prompt": "x" * 5000})
        assert big.status == 413 and (await big.json())["error"]["code"] == "request_too_large"
        state = await (await client.get("/api/state", headers=auth)).json()
        assert state["epoch"] == "3" and state["load"] == {"layers": [0]} and state["events"][0]["detail"] == {"x": 1}
        page = await client.get("/")
        assert page.status == 200 and "cluster.js" in await page.text()
        assert (await client.get("/static/cluster.js")).status == 200
        assert (await client.get("/static/../config.py")).status == 404

    run(FakeHandle([DONE]), check, auth_token="t0ken", max_message_bytes=2048)


def test_http_port_setting():
    ServerConfig(http_port=0).validate()
    ServerConfig(http_port=8000).validate()
    with pytest.raises(ValueError, match="http_port: must be in"):
        ServerConfig(http_port=70000).validate()
    with pytest.raises(ValueError, match="http_port: must differ"):
        ServerConfig(port=9000, http_port=9000).validate()
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="server.http_port"):
            ServerConfig(port=0, http_port=taken.getsockname()[1]).check_can_listen()


class _Unary:
    """A unary Serve method through the fake handle: `remote(*args)` -> an awaitable of `reply(*args)`."""

    def __init__(self, reply):
        self.reply = reply

    def remote(self, *args):
        async def answer():
            result = self.reply(*args)
            if isinstance(result, BaseException):
                raise result
            return result
        return answer()


class ProbeHandle(FakeHandle):
    """The fake handle with the deployment's unary methods the probes, /metrics and the tokenizer paths call."""

    def __init__(self, serving: bool = True):
        super().__init__([DONE])
        from expertmesh.cluster.shard_liveness import HealthVerdict

        self.health_verdict = _Unary(lambda: HealthVerdict(serving, (), "ok" if serving else "layer 0 expert 3 "
                                                                                             "has no live replica"))
        self.GetRouterStats = _Unary(lambda request: admin_pb2.RouterStats(  # noqa: N815 (the Admin RPC's name)
            replica="r0", active_sequences=2, kv_blocks_total=64, steps=9))
        self.OpenAITokenize = _Unary(lambda text, messages: [5, 6, 7] if text else [1, 2])  # noqa: N815
        self.OpenAIDetokenize = _Unary(  # noqa: N815
            lambda ids: ApiError("INVALID_ARGUMENT", "tokens: token id 999 is outside the vocabulary")
            if 999 in ids else "abc")
        self.context_length = _Unary(lambda: 512)


def test_health_metrics_and_tokenizer_paths():
    async def check(client):
        auth = {"Authorization": "Bearer t0ken"}
        for path in ("/health", "/ping"):  # no token needed
            reply = await client.get(path)
            assert reply.status == 200 and (await reply.json()) == {"status": "ok"}
        assert (await client.get("/metrics")).status == 401
        assert (await client.post("/tokenize", json={"prompt": "x"})).status == 401
        await client.post("/v1/completions", headers=auth, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        text = await (await client.get("/metrics", headers=auth)).text()
        assert 'expertmesh_http_requests_total{path="/v1/completions",status="200"} 1' in text
        assert 'expertmesh_http_requests_total{path="/tokenize",status="401"} 1' in text
        assert 'expertmesh_router_active_sequences{replica="r0"} 2' in text
        assert "expertmesh_http_completion_tokens_total 2" in text
        tokens = await (await client.post("/tokenize", headers=auth, json={"model": MODEL, "prompt": "x"})).json()
        assert tokens == {"tokens": [5, 6, 7], "count": 3, "max_model_len": 512}
        chat = await client.post("/tokenize", headers=auth, json={"messages": [{"role": "user", "content": "x"}]})
        assert (await chat.json())["tokens"] == [1, 2]
        other = await client.post("/tokenize", headers=auth, json={"model": "other", "prompt": "x"})
        assert other.status == 404 and (await other.json())["error"]["param"] == "model"
        empty = await client.post("/tokenize", headers=auth, json={"prompt": ""})
        assert empty.status == 400 and (await empty.json())["error"]["param"] == "prompt"
        text = await (await client.post("/detokenize", headers=auth, json={"tokens": [1, 2]})).json()
        assert text == {"prompt": "abc"}
        bad = await client.post("/detokenize", headers=auth, json={"tokens": [1, 999]})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "tokens"
        assert (await (await client.post("/detokenize", headers=auth, json={"tokens": "1"})).json())["error"][
            "param"] == "tokens"

    run(ProbeHandle(), check, auth_token="t0ken")


def test_health_is_503_when_not_serving():
    async def check(client):
        reply = await client.get("/health")
        assert reply.status == 503 and "no live replica" in (await reply.json())["error"]["message"]

    run(ProbeHandle(serving=False), check)
