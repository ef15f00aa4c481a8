"""aiohttp's own parser errors (a bad request line or header, a header too long, bad chunked framing) answered as a
client's mistake: an OpenAI-shaped 400 and one rate-limited log line, never a traceback.

Why: these never reach our handlers or middleware. aiohttp 3.x's RequestHandler (web_protocol.py) turns a parser
error (HttpProcessingError, e.g. BadHttpMessage, LineTooLong, BadStatusLine, InvalidHeader) into an error handler
that calls `handle_error`, which logs "Error handling request" with the whole traceback at ERROR on
`aiohttp.server` and answers a text/plain 400. A body whose framing breaks after a handler answered without reading
it (a 401, or /health with a chunked body) fails in aiohttp's lingering read instead, which logs "Unhandled
exception", again with a traceback. A client on the internet can write either at will, so each became a log flood.

The adapter is a RequestHandler subclass that answers those cases itself and defers everything else (our own
faults: a 500 keeps its traceback) to aiohttp. aiohttp has no option to choose the handler class, so AppRunner
below gives its Server a subclass whose `__call__` (the asyncio protocol factory) builds ours.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from .log_limit import LogRateLimit
from .openai_api import OpenAIError

log = logging.getLogger(__name__)
MAX_REASON_CHARS = 200  # aiohttp's messages can quote the client's bytes; keep what is echoed and logged short
# ConnectionResetError: the client went away mid-body (aiohttp's "Connection lost"); there is no one to answer, and
# without handler_cancellation aiohttp logged it as a 500 with a traceback.
CLIENT_FAULTS = (HttpProcessingError, RequestPayloadError, ConnectionResetError)
_lines = LogRateLimit()


def client_fault(exc: BaseException | None) -> bool:
    """Did the client's bytes cause `exc` (so: a 4xx and a line, not a traceback)?"""
    return isinstance(exc, CLIENT_FAULTS)


def reason(exc: BaseException) -> str:
    """What was wrong, in one short line (aiohttp's message without its repr of the offending bytes' tail)."""
    text = exc.message if isinstance(exc, HttpProcessingError) and exc.message else str(exc)
    text = " ".join(str(text).split())  # one line: a quoted request can hold CR/LF
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "…"


def error_body(status: int, exc: BaseException) -> bytes:
    """The response body: OpenAI's error shape, as every other refusal of the front."""
    error = OpenAIError(status, f"malformed HTTP request: {reason(exc)}", code="bad_request")
    return (json.dumps(error.body()) + "\n").encode()


def note(exc: BaseException, remote: str | None) -> None:
    """One INFO line per kind of fault, at most `_lines.burst` per window (a flood of one kind is counted)."""
    dropped = _lines.admit(type(exc).__name__)
    if dropped is None:
        return
    more = f" ({dropped} more like it dropped)" if dropped else ""
    log.info("malformed HTTP request from %s: %s: %s%s", remote, type(exc).__name__, reason(exc), more)


class QuietRequestHandler(RequestHandler):
    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not client_fault(exc):
            return super().handle_error(request, status, exc, message)  # ours: aiohttp's 500 and traceback
        # A client's broken body that escaped a handler reaches here as a 500: it is still the client's mistake.
        status = status if 400 <= status < 500 else 400
        note(exc, request.remote)
        if request.writer.output_size > 0:  # as aiohttp: a response is already out, nothing more can be said
            raise ConnectionError("response already sent; cannot answer the malformed request")
        response = web.Response(status=status, body=error_body(status, exc), content_type="application/json")
        response.force_close()  # the parser's state is unknown after an error: this connection ends here
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp's "Unhandled exception" after a handler returned: a body the client broke (its lingering read)."""
        exc = kw.get("exc_info")
        if client_fault(exc if isinstance(exc, BaseException) else None):
            note(exc, None)
            return
        super().log_exception(*args, **kw)


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return QuietRequestHandler(self, loop=self._loop, **self._kwargs)


class AppRunner(web.AppRunner):
    """web.AppRunner whose connections are QuietRequestHandlers."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        if type(server) is not web.Server:  # an aiohttp that builds its server differently: fail loudly in tests
            raise TypeError(f"unexpected aiohttp server class {type(server).__name__}")
        server.__class__ = _Server  # same state, our protocol factory (web.Server has no option for it)
        return server
