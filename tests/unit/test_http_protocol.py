"""Hostile bytes at the HTTP front (router_service/http_protocol.py, json_body.py) over raw sockets, against the
front as `expertmesh serve` starts it with a fake router handle (no Ray): aiohttp's own parser errors and every kind
of bad body are a 4xx in OpenAI's shape, and nothing is logged with a traceback or at ERROR."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from expertmesh.router_service import http_protocol
from expertmesh.router_service.config import ServerConfig
from expertmesh.router_service.http_front import start_http_front
from tests.hostile_http import BODY_ERRORS, GOOD_BODY, NOT_HTTP, PARSER_ERRORS, _post, request, send_raw

LIMIT = 1 << 20
MODEL = "m"  # the model GOOD_BODY names
DONE = {"done": {"finish_reason": "length", "prompt_tokens": 2, "completion_tokens": 1, "tokens_per_expert": {},
                 "rerouted": 0, "degraded": 0, "dropped": 0}}


class FakeCall:
    """A Serve streaming call answering one token and its end."""

    def __aiter__(self):
        return self._events()

    async def _events(self):
        yield {"token": {"ids": [7], "text": "a", "logprobs": None}}
        yield DONE

    def cancel(self) -> None:
        pass


class FakeHandle:
    """The router deployment handle, as far as a completion needs it."""

    def options(self, **_):
        return self

    @property
    def OpenAIGenerate(self):  # noqa: N802
        return self

    def remote(self, job):
        return FakeCall()


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def answers(cases: list[tuple[str, bytes]], **settings) -> tuple[list, list[logging.LogRecord]]:
    """The raw replies to each case's bytes (one connection each) and every log record meanwhile."""
    records = Records()
    root = logging.getLogger()
    root.addHandler(records)
    level, root.level = root.level, logging.DEBUG

    async def main():
        config = ServerConfig(http_port=0, max_message_bytes=LIMIT, **settings)
        runner, port = await start_http_front(FakeHandle(), config, MODEL)
        try:
            return [await asyncio.to_thread(send_raw, "127.0.0.1", port, data) for _, data in cases]
        finally:
            await runner.cleanup()

    try:
        return asyncio.run(main()), records.records
    finally:
        root.removeHandler(records)
        root.level = level


def assert_quiet(records: list[logging.LogRecord]) -> None:
    loud = [r for r in records if r.exc_info or r.levelno >= logging.ERROR or "Traceback" in r.getMessage()]
    assert not loud, [(r.name, r.getMessage()[:200]) for r in loud]


def test_parser_errors_are_openai_shaped_400s_without_a_traceback():
    replies, records = answers([(n, d) for n, d in PARSER_ERRORS + NOT_HTTP])
    for (name, _), reply in zip(PARSER_ERRORS + NOT_HTTP, replies):
        assert reply.status == 400, (name, reply)
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "bad_request", (name, error)
        assert error["message"].startswith("malformed HTTP request: ") and "\n" not in error["message"]
        assert len(error["message"]) < 300
    assert_quiet(records)
    lines = [r for r in records if r.name == http_protocol.log.name]
    assert 1 <= len(lines) <= 5 * 6, len(lines)  # one INFO line per fault, rate-limited per kind


@pytest.mark.parametrize("token_set", [False, True])
def test_bad_bodies_are_refused_by_the_front_naming_the_field(token_set):
    settings = {"auth_token": "tok"} if token_set else {}
    auth = {"Authorization": "Bearer tok"} if token_set else {}
    cases = [(name, data.replace(b"Content-Type:", b"".join(f"{k}: {v}\r\n".encode() for k, v in auth.items())
                                 + b"Content-Type:", 1) if name != "non-UTF-8 authorization" else data)
             for name, data, _, _ in BODY_ERRORS]
    replies, records = answers(cases, **settings)
    for (name, _, status, param), reply in zip(BODY_ERRORS, replies):
        if name == "non-UTF-8 authorization":  # a header aiohttp decoded with surrogateescape: compared, not a 500
            assert reply.status == (401 if token_set else 200), reply
            continue
        assert reply.status == status, (name, reply)
        error = reply.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (name, error)
        assert "Traceback" not in error["message"]
    assert_quiet(records)


def test_a_chunked_body_over_the_limit_is_413_and_a_good_one_passes():
    chunk = b"a" * 60_000
    big = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(20)) + b"0\r\n\r\n"  # 1.2 MB > 1 MiB
    good = b"%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD_BODY), GOOD_BODY)
    cases = [("big", _post("/v1/completions", big, **{"Transfer-Encoding": "chunked"})),
             ("good", _post("/v1/completions", good, **{"Transfer-Encoding": "chunked"})),
             ("no content type", request("POST", "/v1/completions", GOOD_BODY))]
    (too_big, fine, untyped), records = answers(cases)
    assert too_big.status == 413 and too_big.json()["error"]["code"] == "request_too_large"
    assert fine.status == 200 and fine.json()["choices"][0]["text"] == "a"
    assert untyped.status == 200  # no Content-Type at all: JSON, as FastAPI-based servers take it
    assert_quiet(records)


def test_our_own_faults_keep_aiohttps_500_and_traceback():
    """Only a client's bytes are quietened: anything else is still a 500 logged with its traceback."""
    assert http_protocol.client_fault(http_protocol.RequestPayloadError("bad chunk"))
    assert not http_protocol.client_fault(RuntimeError("our bug")) and not http_protocol.client_fault(None)
    assert http_protocol.reason(RuntimeError("a\n  b " + "x" * 500)).startswith("a b x")
    assert len(http_protocol.reason(RuntimeError("x" * 500))) == http_protocol.MAX_REASON_CHARS + 1


def test_a_broken_body_that_escapes_a_handler_is_400_not_500():
    """A handler that reads a body without json_body (none of ours does today) and lets the read's error escape:
    aiohttp answered 500 and logged a traceback; the adapter answers 400 and logs a line. A bad chunk that arrives
    while such a handler reads ended in aiohttp's 500 "Connection lost" with a traceback: now quiet."""
    from aiohttp import web

    async def escapes(request: web.Request) -> web.Response:
        raise http_protocol.RequestPayloadError("Invalid character in chunk size")

    async def reads(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text="read")

    def split(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request("POST", "/reads", b"", {"Transfer-Encoding": "chunked"}) + b"2\r\n{}\r\n")
            time.sleep(0.3)  # the handler is reading the body when the bad chunk comes
            sock.sendall(b"zz\r\n")
            sock.settimeout(2)  # aiohttp may keep the connection open without answering; what counts is the log
            try:
                return sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                return b""

    records = Records()
    logging.getLogger().addHandler(records)

    async def main():
        app = web.Application()
        app.router.add_post("/escapes", escapes)
        app.router.add_post("/reads", reads)
        runner = http_protocol.AppRunner(app)  # without handler_cancellation, unlike the front: the harder case
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            first = await asyncio.to_thread(send_raw, "127.0.0.1", port, request("POST", "/escapes", b"{}"))
            await asyncio.to_thread(split, port)
            await asyncio.sleep(0.5)
            return first
        finally:
            await runner.cleanup()

    try:
        reply = asyncio.run(main())
    finally:
        logging.getLogger().removeHandler(records)
    assert reply.status == 400 and reply.json()["error"]["code"] == "bad_request", reply
    assert_quiet(records.records)
