"""expertmesh's HTTP ingress: the OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions, with
vLLM's /tokenize and /detokenize), probes (/health, /ping), Prometheus text (/metrics) and the live cluster page
(/ and /api/state), on an aiohttp server in the `expertmesh serve` process, beside the gRPC front.

Why our own front rather than Ray Serve's HTTP proxy: Serve's proxy is one more listener per node, on its own host
and port settings, without our bearer token or the TLS material the gRPC front uses; this front shares exactly what
the gRPC front has — the same router deployment handle (so the same continuous batcher and KV caches), the same
`server` settings (host, auth_token, tls_cert/tls_key, max_message_bytes), the same error mapping — and is off
unless `server.http_port` is set. Request and response mapping is pure, in router_service/openai_api.py.

A client that disconnects cancels its handler (aiohttp handler_cancellation), which cancels the Serve call, which
closes the batcher stream on the replica and frees the sequence's KV cache: the same path as a gRPC cancel.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web
from google.protobuf.json_format import MessageToDict
from ray import serve

from ..experts.gil_handoff import shorten_gil_switch_interval
from ..experts.token_compare import bearer_matches
from ..protos import admin_pb2
from . import http_metrics, http_protocol, http_resume, json_body, openai_api, openai_responses
from .config import ConfigError, ServerConfig
from .grpc_front import _api_error
from .log_limit import LogRateLimit
from .model_routes import ModelRequired, UnknownModel, choose
from .openai_api import OpenAIError
from .serve_calls import cancel_with_caller

log = logging.getLogger(__name__)
STATIC = Path(__file__).resolve().parent / "static"
PAGE_FILES = {"cluster.js": "text/javascript", "cluster.css": "text/css"}
STATE_TIMEOUT_S = 10.0
HEALTH_TIMEOUT_S = 5.0
# Paths behind the bearer token (with --auth-token); /health and /ping stay open for load balancers and probes.
GUARDED = ("/v1/", "/api/", "/tokenize", "/detokenize", "/metrics")
# handler_cancellation: a client that goes away cancels its handler even while no byte is being written (a request
# still queued for a batch slot), so the Serve call is cancelled at once, not at the next write.
RUNNER_OPTIONS = {"handler_cancellation": True, "access_log": None}
_warnings = LogRateLimit()


def json_response(body: dict, status: int = 200) -> web.Response:
    """JSON ending in a newline, so `curl` output reads line by line."""
    return web.json_response(body, status=status, dumps=lambda obj: json.dumps(obj) + "\n")


def error_response(error: OpenAIError) -> web.Response:
    return json_response(error.body(), status=error.status)


def _as_openai_error(exc: BaseException) -> OpenAIError:
    """A failed Serve call as an OpenAI error: the deployment's ApiError by its code, anything else 503."""
    if isinstance(exc, OpenAIError):
        return exc
    known = _api_error(exc)
    if known is not None:
        return openai_api.from_status(known.code, known.message)
    dropped = _warnings.admit(type(exc).__name__)
    if dropped is not None:
        log.warning("router call failed: %s", repr(exc)[:1024])
    return OpenAIError(503, f"router unavailable ({type(exc).__name__}); retry", code="service_unavailable")


class _Mesh:
    """One mesh's router deployment as the HTTP front calls it, and the model name it serves."""

    def __init__(self, handle: serve.handle.DeploymentHandle, model_name: str):
        # By value, as the gRPC front streams Generate (one Ray object per token cost as much as the expert round).
        self.stream_handle = handle.options(_by_reference=False, stream=True)
        self.unary_handle = handle.options(_by_reference=True)
        self.model_name = model_name


def _routing_error(exc: UnknownModel | ModelRequired) -> OpenAIError:
    if isinstance(exc, UnknownModel):
        return OpenAIError(404, exc.message, param="model", code="model_not_found")
    return OpenAIError(400, exc.message, param="model", code="invalid_value")


class HttpFront:
    """`handles`: {served model name: router deployment handle}, one per mesh this front serves. With one mesh,
    everything is as it always was; with several, a request goes to the mesh its `model` names
    (router_service/model_routes.py), /v1/models lists every mesh's model, /metrics covers every mesh (labelled by
    model) and /api/state answers for the mesh `?model=` names (default: the first)."""

    def __init__(self, handles: Mapping[str, serve.handle.DeploymentHandle], settings: ServerConfig):
        self.meshes = {model: _Mesh(handle, model) for model, handle in handles.items()}
        assert self.meshes, "an HTTP front serves at least one mesh"
        self.first = next(iter(self.meshes.values()))
        self.settings = settings
        self.created = int(time.time())
        self.counters = http_metrics.FrontCounters()

    def _mesh(self, model: object) -> _Mesh:
        """The mesh answering a request naming `model` (None: not named). With one mesh, that mesh: the request
        parsers check the name, with the messages single-mesh clients always got."""
        if len(self.meshes) == 1:
            return self.first
        if model is not None and not isinstance(model, str):
            raise openai_api.invalid("model", "must be a model name (a string; GET /v1/models lists them)")
        try:
            return choose(model, self.meshes)
        except (UnknownModel, ModelRequired) as exc:
            raise _routing_error(exc) from None

    def _mesh_of_query(self, request: web.Request) -> _Mesh:
        """/metrics?model= and /api/state: the mesh `?model=` names, else the first."""
        model = request.query.get("model")
        return self.first if model is None else self._mesh(model)

    # ---- plumbing ----------------------------------------------------------------------------------------------

    @web.middleware
    async def guard(self, request: web.Request, handler):
        """Bearer token on the API and the state (the page itself holds no data); every error in OpenAI's shape."""
        response = await self._guarded(request, handler)
        route = request.match_info.route.resource
        # Counted by route (a bounded set), not by the raw path a client may make up.
        self.counters.count_request(route.canonical if route is not None else "unknown", response.status)
        return response

    async def _guarded(self, request: web.Request, handler):
        try:
            if request.path.startswith(GUARDED) and self.settings.auth_token is not None:
                if not bearer_matches(request.headers.get("Authorization"), self.settings.auth_token):
                    raise OpenAIError(401, "authorization: missing or wrong bearer token (send `Authorization: "
                                           "Bearer <token>`)", code="invalid_api_key")
            return await handler(request)
        except OpenAIError as exc:
            return error_response(exc)
        except web.HTTPException as exc:
            if exc.status == 413:
                return error_response(json_body.too_large(request.content_length, self.settings.max_message_bytes))
            if exc.status < 400:
                raise
            return error_response(OpenAIError(exc.status, exc.reason or "request refused"))

    async def _body(self, request: web.Request) -> dict:
        """The JSON object in the body, or an OpenAI-shaped 4xx (router_service/json_body.py)."""
        return await json_body.read_json_object(request, self.settings.max_message_bytes,
                                                self.settings.max_json_depth)

    # ---- the OpenAI API ----------------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [openai_api.models_list(model, self.created)["data"][0]
                                                         for model in self.meshes]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] not in self.meshes:
            raise OpenAIError(404, f"model: the model {request.match_info['model'][:64]!r} does not exist",
                              param="model", code="model_not_found")
        return json_response(openai_api.models_list(request.match_info["model"], self.created)["data"][0])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        mesh = self._mesh(body.get("model"))
        job = openai_api.parse_completion(body, mesh.model_name)
        return await self._generate(request, mesh, job, f"cmpl-{uuid.uuid4().hex}")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        mesh = self._mesh(body.get("model"))
        job = openai_api.parse_chat(body, mesh.model_name)
        return await self._generate(request, mesh, job, f"chatcmpl-{uuid.uuid4().hex}")

    async def _generate(self, request: web.Request, mesh: _Mesh, job: openai_api.OpenAIJob, request_id: str):
        created = int(time.time())
        # Resumed on a live router replica of its mesh when the one serving it dies (router_service/http_resume.py).
        call = http_resume.ResumingCall(mesh.stream_handle, job)
        finished = False
        try:
            events = call.__aiter__()
            try:
                # The first event before any header: a refused request (bad prompt, queue full, no replica) gets
                # its own HTTP status, not a 200 stream with an error inside.
                first = await events.__anext__()
            except StopAsyncIteration:
                raise OpenAIError(500, "the router ended the stream without a result") from None
            except Exception as exc:
                raise _as_openai_error(exc) from None
            if not job.stream:
                got = openai_responses.Accumulated()
                got.add(first)
                try:
                    async for event in events:
                        got.add(event)
                except Exception as exc:
                    raise _as_openai_error(exc) from None
                finished = True
                body = openai_responses.response(job, request_id, created, got)
                self.counters.count_usage(body["usage"])
                return json_response(body)
            return await self._stream(request, job, request_id, created, first, events, call)
        finally:
            if not finished:
                call.cancel()  # disconnect, error, or a stream that ended: idempotent, frees the sequence

    async def _stream(self, request, job, request_id, created, first, events, call) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        writer = openai_responses.ChunkWriter(job, request_id, created)
        for chunk in writer.first() + writer.event(first):
            await response.write(openai_api.sse(chunk))
        try:
            async for event in events:
                for chunk in writer.event(event):
                    await response.write(openai_api.sse(chunk))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # headers are out: the error travels as an event, as OpenAI's streams do
            await response.write(openai_api.sse(_as_openai_error(exc).body()))
        finally:
            if writer.dones:
                self.counters.count_usage(openai_responses.usage_of(job, writer.dones))
        await response.write(openai_api.SSE_DONE)
        await response.write_eof()
        return response

    # ---- tokenizer, probes, metrics ----------------------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /tokenize: {model?, prompt} or {model?, messages} -> {tokens, count, max_model_len}."""
        body = await self._body(request)
        mesh = self._optional_model(body)
        messages, prompt = body.get("messages"), body.get("prompt")
        if messages is not None:
            job = openai_api.parse_chat({"model": mesh.model_name, "messages": messages}, mesh.model_name)
            args = (None, list(job.messages))
        elif isinstance(prompt, str) and prompt:
            args = (prompt, None)
        else:
            raise openai_api.invalid("prompt", "required: a non-empty string (or messages)")
        try:
            # retried on a live replica if its replica dies; cancelled there if the client leaves
            ids = await http_resume.unary(lambda: cancel_with_caller(mesh.unary_handle.OpenAITokenize.remote(*args)))
        except Exception as exc:
            raise _as_openai_error(exc) from None
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": await self._context(mesh)})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /detokenize: {model?, tokens: [ids]} -> {prompt}."""
        body = await self._body(request)
        mesh = self._optional_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise openai_api.invalid("tokens", "required: a list of token ids")
        try:
            text = await http_resume.unary(
                lambda: cancel_with_caller(mesh.unary_handle.OpenAIDetokenize.remote(tokens)))
        except Exception as exc:
            raise _as_openai_error(exc) from None
        return json_response({"prompt": text})

    def _optional_model(self, body: dict) -> _Mesh:
        """/tokenize and /detokenize: `model` is optional (required only when this front serves several)."""
        model = body.get("model")
        if len(self.meshes) > 1:
            return self._mesh(model)
        if model is not None and model != self.first.model_name:
            raise OpenAIError(404, f"model: the model {str(model)[:64]!r} does not exist; this server serves "
                                   f"{self.first.model_name!r}", param="model", code="model_not_found")
        return self.first

    async def _context(self, mesh: _Mesh) -> int | None:
        try:
            meta = await mesh.unary_handle.context_length.remote()
        except Exception:
            return None
        return meta

    async def health(self, request: web.Request) -> web.Response:
        """GET /health and /ping: 200 while the router can answer every request (the gRPC health check's verdict),
        503 with the reason otherwise. No token: load balancers and load generators probe it. Over several meshes:
        200 while every mesh can (the reason of a 503 names the model)."""
        several = len(self.meshes) > 1
        for mesh in self.meshes.values():
            which = f"{mesh.model_name!r}: " if several else ""
            try:
                verdict = await asyncio.wait_for(mesh.unary_handle.health_verdict.remote(), HEALTH_TIMEOUT_S)
            except Exception as exc:
                raise OpenAIError(503, f"{which}router unavailable ({type(exc).__name__})",
                                  code="service_unavailable") from None
            if not verdict.serving:
                raise OpenAIError(503, f"{which}not serving: {verdict.reason}", code="service_unavailable")
        return json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text: the front's counters and the answering router replica's stats; over several meshes,
        every mesh's (labelled by model), or only the mesh `?model=` names."""
        if len(self.meshes) == 1 or "model" in request.query:
            router = await self._router_stats(self._mesh_of_query(request))
            by_model = None if len(self.meshes) == 1 else {self._mesh_of_query(request).model_name: router}
        else:
            stats = await asyncio.gather(*(self._router_stats(mesh) for mesh in self.meshes.values()))
            router, by_model = None, dict(zip(self.meshes, stats, strict=True))
        return web.Response(text=http_metrics.prometheus_text(self.counters, router, by_model),
                            content_type="text/plain", charset="utf-8", headers={"Cache-Control": "no-cache"})

    async def _router_stats(self, mesh: _Mesh) -> dict | None:
        """A router replica's GetRouterStats reply as a dict, None when none answered in time."""
        try:
            reply = await asyncio.wait_for(
                mesh.unary_handle.GetRouterStats.remote(admin_pb2.RouterStatsRequest()), STATE_TIMEOUT_S)
        except Exception as exc:
            dropped = _warnings.admit("metrics:" + type(exc).__name__)
            if dropped is not None:
                log.warning("/metrics: router stats unavailable: %s", repr(exc)[:512])
            return None
        return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    # ---- the cluster page --------------------------------------------------------------------------------------

    async def state(self, request: web.Request) -> web.Response:
        """The Admin GetClusterState reply as JSON (its embedded JSON strings parsed), for the page."""
        mesh = self._mesh_of_query(request)
        try:
            reply = await asyncio.wait_for(
                mesh.unary_handle.GetClusterState.remote(admin_pb2.ClusterStateRequest()), STATE_TIMEOUT_S)
        except Exception as exc:
            raise _as_openai_error(exc) from None
        return json_response(cluster_state_json(reply))

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "cluster.html", headers={"Cache-Control": "no-cache"})

    async def asset(self, request: web.Request) -> web.FileResponse:
        name = request.match_info["name"]
        if name not in PAGE_FILES:
            raise OpenAIError(404, f"no such file: {name[:64]!r}", code="not_found")
        return web.FileResponse(STATIC / name, headers={"Content-Type": PAGE_FILES[name],
                                                        "Cache-Control": "no-cache"})

    def app(self) -> web.Application:
        # The body limit is enforced in _body (and by aiohttp beyond it, as a backstop).
        app = web.Application(middlewares=[self.guard], client_max_size=self.settings.max_message_bytes)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/api/state", self.state)
        app.router.add_get("/", self.page)
        app.router.add_get("/static/{name}", self.asset)
        return app


def cluster_state_json(reply: admin_pb2.ClusterState) -> dict:
    state = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    state["load"] = json.loads(state.pop("load_json") or "null")
    state["control"] = json.loads(state.pop("control_json") or "[]")
    router = state.get("router") or {}
    router.pop("load_json", None)
    for event in state.get("events", []):
        event["detail"] = json.loads(event.pop("detail_json") or "{}")
    return state


def tls_context(settings: ServerConfig) -> ssl.SSLContext | None:
    if not settings.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.tls_cert, settings.tls_key)
    return context


async def start_http_front(handle: serve.handle.DeploymentHandle | Mapping[str, serve.handle.DeploymentHandle],
                           settings: ServerConfig, model_name: str | None = None) -> tuple[web.AppRunner, int]:
    """Serve the HTTP API on settings.host:settings.http_port; returns the runner (cleanup() stops it) and the
    port it bound (useful with port 0). `handle` and `model_name`: one mesh and the name it serves; or `handle`
    alone, {served model name: handle}, for a front over several meshes."""
    shorten_gil_switch_interval()  # the front's loop relays events from Serve's threads (experts/gil_handoff.py)
    if isinstance(handle, Mapping):
        assert model_name is None, "the model names are the mapping's keys"
        handles = handle
    else:
        assert model_name, "one mesh: the name it serves"
        handles = {model_name: handle}
    # Its connections answer aiohttp's own parser errors as a client's mistake (router_service/http_protocol.py).
    runner = http_protocol.AppRunner(HttpFront(handles, settings).app(), **RUNNER_OPTIONS)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.http_port, ssl_context=tls_context(settings),
                       reuse_port=False)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError("server.http_port", f"cannot listen on {settings.host}:{settings.http_port}: "
                                              f"{exc.strerror or exc}") from None
    port = site._server.sockets[0].getsockname()[1]
    return runner, port
