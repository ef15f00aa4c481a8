"""expertmesh's gRPC ingress: a grpc.aio server that forwards every call to the router deployment through Serve
handles.

Why not only Serve's own gRPC proxy: it listens on every interface and has no TLS. This front listens where it is
told (127.0.0.1 by default), terminates TLS when given a certificate and key, checks a bearer token, caps message
size, and maps failures to gRPC codes without leaking tracebacks. Replicas, autoscaling and replacement of failed
router replicas stay Serve's job. A client cancel or deadline cancels the Serve call, which cancels the sequence.
A Generate stream whose router replica dies resumes on a live one (router_service/continuation.py; the rule shared
with the HTTP front: resume_streak.py): the client sees neither an error nor a repeated token. Read-only unary calls
are re-sent to a live replica the same way (resuming.retried).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray import serve
from ray.serve.exceptions import ReplicaUnavailableError

from ..experts.telemetry import carrier_from_metadata
from ..experts.token_compare import bearer_matches
from ..protos import admin_pb2_grpc, inference_pb2_grpc, kserve_v2_pb2_grpc
from . import health
from .admin_auth import DESTRUCTIVE_ADMIN_METHODS, admin_denial
from .config import ConfigError, ServerConfig
from .continuation import StreamProgress, with_resumable_seed
from .log_limit import LogRateLimit
from .malformed_requests import RefuseMalformedRequests
from .model_routes import MODEL_METADATA, ModelRequired, UnknownModel, choose
from .proto_mapping import ApiError
from .resume_streak import MAX_RESUMES, RESUME_BACKOFF_MAX_S, RESUME_BACKOFF_S, RESUME_WAIT_S, ResumeStreak
from .resuming import first_then_rest, retried
from .serve_calls import cancel_with_caller
from .step_profile import StageClock

MAX_DETAILS_CHARS = 1024  # status details travel in a trailer (16 KiB by default); errors already cap echoed input

log = logging.getLogger(__name__)


def _api_error(exc: BaseException) -> ApiError | None:
    """The ApiError a deployment raised, through Ray's wrapping."""
    while exc is not None:
        if isinstance(exc, ApiError):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def replica_lost(exc: BaseException) -> bool:
    """Did the call fail because its router replica died (retry elsewhere), not because of the request itself?

    Ray 2.60 surfaces a replica killed mid-stream as ActorUnavailableError (its by-value gRPC stream broke) or
    ActorDiedError, both RayActorError, possibly as the cause of a RayTaskError; Serve's ReplicaUnavailableError
    says the same. An ApiError is the deployment's answer to this request: never retried."""
    while exc is not None:
        if isinstance(exc, ApiError):
            return False
        if isinstance(exc, ray.exceptions.RayActorError | ReplicaUnavailableError):
            return True
        exc = getattr(exc, "cause", None) or exc.__cause__
    return False


class _Forwarder:
    def __init__(self, handle: serve.handle.DeploymentHandle, auth_token: str | None, admin_token: str | None):
        # By value over Serve's inter-deployment gRPC instead of one Ray object per streamed token: at 32 streams
        # the per-item cost of by-reference streaming was about as large as the whole expert round.
        self.handle = handle.options(_by_reference=False)
        self.stream_handle = self.handle.options(stream=True)
        # Unary calls by reference (a Ray object for the request and one for the result): their one result can be
        # large (Score / ModelInfer logits: positions × vocabulary × 4 bytes, 4 MiB for the embedded model's whole
        # context) and the by-value hop's channel takes only gRPC's 4 MiB default; one object per call costs
        # nothing next to a forward pass.
        self.unary_handle = handle.options(_by_reference=True)
        self.auth_token = auth_token
        self.warnings = LogRateLimit()
        self.admin_token = admin_token
        self.profile = StageClock()  # front.* stages, added to every GetRouterStats reply (step_profile.py)

    async def authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self.auth_token is None:
            return
        metadata = dict(context.invocation_metadata() or ())
        if not bearer_matches(metadata.get("authorization"), self.auth_token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong bearer token")

    async def authorize_admin(self, context: grpc.aio.ServicerContext) -> None:
        """Kill/Drain/UndrainReplica: the admin token too (router_service/admin_auth.py); the deployment trusts
        calls that come through this front's handle, so this is where it is checked."""
        denied = admin_denial(self.admin_token, dict(context.invocation_metadata() or ()))
        if denied is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, denied)

    async def fail(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        error = _api_error(exc)
        if error is not None:
            await context.abort(getattr(grpc.StatusCode, error.code), error.message[:MAX_DETAILS_CHARS])
        dropped = self.warnings.admit(type(exc).__name__)
        if dropped is not None:
            more = f" ({dropped} more like it dropped)" if dropped else ""
            log.warning("router call failed: %s%s", repr(exc)[:MAX_DETAILS_CHARS], more)
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"router unavailable ({type(exc).__name__}); retry")

    async def unary(self, method: str, request, context: grpc.aio.ServicerContext):
        await self.authorize(context)
        if method in DESTRUCTIVE_ADMIN_METHODS:
            await self.authorize_admin(context)
        try:
            # A client cancel or deadline cancels this handler; cancel_with_caller passes it on to the replica.
            if method in DESTRUCTIVE_ADMIN_METHODS:  # acted on once: a lost reply is the caller's to judge
                reply = await cancel_with_caller(getattr(self.unary_handle, method).remote(request))
            else:  # read-only: re-sent to a live router replica when the one serving it dies
                reply = await retried(lambda: cancel_with_caller(getattr(self.unary_handle, method).remote(request)),
                                      replica_lost,
                                      ResumeStreak(MAX_RESUMES, RESUME_WAIT_S, RESUME_BACKOFF_S, RESUME_BACKOFF_MAX_S),
                                      self._note_retry)
            if method == "GetRouterStats":
                reply.stage_seconds.update(self.profile.snapshot())
            return reply
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self.fail(context, exc)

    async def stream(self, method: str, request, context: grpc.aio.ServicerContext) -> None:
        """Relay a server-streaming call (Generate, the only one), writing each message itself, and resume it on a
        live router replica when the one serving it dies (up to MAX_RESUMES times, within the client's deadline).

        A coroutine rather than an async generator: grpcio's generator API writes each yielded message outside the
        generator, so a client cancel that lands during that write (typically right after a token went out) raised
        there and left the generator suspended at its `yield`; nothing then cancelled the Serve call and the
        sequence decoded on to max_tokens. Here every way out (cancel, deadline, a failed write, an abort) passes
        the `finally`, which cancels the Serve call unless it ran to its end."""
        await self.authorize(context)
        # The caller's trace context (W3C `traceparent` metadata) goes on to the router, which makes the request
        # span its child; sent only when present, so the call is unchanged without tracing.
        carrier = carrier_from_metadata(context.invocation_metadata())
        extra = {"trace": carrier} if carrier else {}
        progress = StreamProgress(with_resumable_seed(request))
        # The resume rule shared with the HTTP front (router_service/resume_streak.py); the limits read here so a
        # test can lower them.
        streak = ResumeStreak(MAX_RESUMES, RESUME_WAIT_S, RESUME_BACKOFF_S, RESUME_BACKOFF_MAX_S)
        while True:
            responses = getattr(self.stream_handle, method).remote(progress.next_request(), **extra)
            first_wait_s = streak.first_wait(context.time_remaining())
            finished = False
            try:
                async for message in first_then_rest(responses, first_wait_s):
                    relaying = time.perf_counter()
                    await context.write(message)
                    progress.record(message)
                    self.profile.since("front.relay", relaying)
                finished = True
                return
            except Exception as exc:  # (a client cancel or deadline is a CancelledError: straight to the finally)
                backoff = streak.failed(len(progress.delivered))
                if backoff is None or progress.done or not replica_lost(exc):
                    await self.fail(context, exc)
                self._note_resume(exc, len(progress.delivered), streak.failures - 1)
            finally:
                if not finished:
                    responses.cancel()  # best effort and idempotent; a no-op for a call that already failed
            await asyncio.sleep(backoff)

    def _note_retry(self, exc: BaseException, attempt: int) -> None:
        dropped = self.warnings.admit(f"retry:{type(exc).__name__}")
        if dropped is not None:
            more = f" ({dropped} more like it dropped)" if dropped else ""
            log.warning("router replica lost under a unary call (%s); retrying, attempt %d%s",
                        type(exc).__name__, attempt + 1, more)

    def _note_resume(self, exc: BaseException, delivered: int, attempt: int) -> None:
        dropped = self.warnings.admit(f"resume:{type(exc).__name__}")
        if dropped is not None:
            more = f" ({dropped} more like it dropped)" if dropped else ""
            log.warning("router replica lost mid-stream (%s); resuming after %d tokens, attempt %d%s",
                        type(exc).__name__, delivered, attempt + 1, more)


# The request field naming the model, by method; the methods not here have none (server-wide or admin calls).
MODEL_FIELDS = {"Generate": "model", "Score": "model", "ModelInfer": "model_name", "ModelReady": "name",
                "ModelMetadata": "name"}


# Calls without a model field whose answer does not depend on the mesh (the server's name and version).
SAME_ON_EVERY_MESH = frozenset({"ServerMetadata"})


class _Meshes:
    """The forwarders of the meshes this front serves, and which one a call goes to.

    One mesh given as a bare handle (`expertmesh serve`, a single-mesh `expertmesh front`): every call goes to it
    and the router checks the model name itself, as always. Several (model name -> handle): the request's model
    field chooses (router_service/model_routes.py); a call without one (Admin) names the model in
    `x-expertmesh-model` metadata, except ServerLive and ServerReady, which answer for the whole front, and
    ServerMetadata, the same on every mesh (the first answers unless the metadata names one)."""

    def __init__(self, forwarders: dict[str, _Forwarder] | _Forwarder):
        self.single = forwarders if isinstance(forwarders, _Forwarder) else None
        self.by_model = {} if self.single is not None else forwarders
        self.first = self.single or next(iter(self.by_model.values()))

    def all(self) -> list[_Forwarder]:
        return [self.single] if self.single is not None else list(self.by_model.values())

    async def pick(self, method: str, request, context: grpc.aio.ServicerContext) -> _Forwarder:
        if self.single is not None:
            return self.single
        await self.first.authorize(context)  # a client without the token learns nothing about the models
        field = MODEL_FIELDS.get(method)
        if field is not None:
            requested = getattr(request, field)
        else:
            field = f"metadata {MODEL_METADATA}"
            requested = dict(context.invocation_metadata() or ()).get(MODEL_METADATA, "")
            if not requested and method in SAME_ON_EVERY_MESH:
                return self.first
        try:
            return choose(requested, self.by_model, field)
        except UnknownModel as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, exc.message[:MAX_DETAILS_CHARS])
        except ModelRequired as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message[:MAX_DETAILS_CHARS])


def _unary(method: str):
    async def handler(self, request, context):
        if method in ("ServerLive", "ServerReady") and self._meshes.single is None:
            return await _whole_front(self._meshes, method, request, context)
        forward = await self._meshes.pick(method, request, context)
        return await forward.unary(method, request, context)

    return handler


async def _whole_front(meshes: _Meshes, method: str, request, context: grpc.aio.ServicerContext):
    """ServerLive / ServerReady of a front over several meshes: live or ready when every mesh says so (KServe's
    server-wide calls; a mesh that does not answer fails the call, as it would with one mesh)."""
    replies = [await forward.unary(method, request, context) for forward in meshes.all()]
    field = "live" if method == "ServerLive" else "ready"
    return type(replies[0])(**{field: all(getattr(r, field) for r in replies)})


def _streaming(method: str):
    async def handler(self, request, context):
        forward = await self._meshes.pick(method, request, context)
        await forward.stream(method, request, context)

    return handler


def _servicer(base: type, meshes: _Meshes, unary: list[str], streaming: list[str]):
    methods = {m: _unary(m) for m in unary} | {m: _streaming(m) for m in streaming}
    cls = type(f"Forwarding{base.__name__}", (base,), methods)
    instance = cls()
    instance._meshes = meshes
    return instance


class _Health(health_pb2_grpc.HealthServicer):
    """The router deployment's verdict (NOT_SERVING while a shard has no live replica the policy can do without,
    see deployment.health_verdict); NOT_SERVING too, not an error, when the deployment does not answer. Over several
    meshes: SERVING only while every mesh is."""

    def __init__(self, meshes: _Meshes):
        self._meshes = meshes

    async def _status(self) -> int:
        try:
            # The whole server's status; the service name was checked here.
            replies = await asyncio.wait_for(asyncio.gather(*(
                forward.handle.Check.remote(health_pb2.HealthCheckRequest()) for forward in self._meshes.all())),
                timeout=10)
        except Exception:
            return health.NOT_SERVING
        return health.SERVING if all(r.status == health.SERVING for r in replies) else health.NOT_SERVING

    async def Check(self, request, context):  # noqa: N802
        if not health.known_service(request.service):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"service: unknown service {request.service[:200]!r}")
        return health.response(await self._status())

    async def Watch(self, request, context):  # noqa: N802
        async for message in health.watch(request.service, self._status):
            yield message


async def start_front(handle: serve.handle.DeploymentHandle | Mapping[str, serve.handle.DeploymentHandle],
                      settings: ServerConfig) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the port it bound (useful with port 0). `handle`: one mesh's router
    deployment, or {served model name: handle} for a front over several meshes (each call goes to the mesh its
    request's model names: _Meshes)."""
    settings.validate()
    server = grpc.aio.server(interceptors=[RefuseMalformedRequests()], options=[
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_response_bytes),
        # gRPC's default SO_REUSEPORT would let this front share a port another server already listens on.
        ("grpc.so_reuseport", 0),
    ])
    if isinstance(handle, Mapping):
        meshes = _Meshes({model: _Forwarder(h, settings.auth_token, settings.admin_token)
                           for model, h in handle.items()})
    else:
        meshes = _Meshes(_Forwarder(handle, settings.auth_token, settings.admin_token))
    inference_pb2_grpc.add_InferenceServicer_to_server(
        _servicer(inference_pb2_grpc.InferenceServicer, meshes, ["Score"], ["Generate"]), server)
    kserve_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
        _servicer(kserve_v2_pb2_grpc.GRPCInferenceServiceServicer, meshes,
                  ["ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"], []),
        server)
    admin_pb2_grpc.add_AdminServicer_to_server(
        _servicer(admin_pb2_grpc.AdminServicer, meshes,
                  ["GetRouterStats", "GetClusterState", *sorted(DESTRUCTIVE_ADMIN_METHODS)], []), server)
    health_pb2_grpc.add_HealthServicer_to_server(_Health(meshes), server)
    address = f"{settings.host}:{settings.port}"
    try:
        if settings.tls_cert:
            key, cert = Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes()
            port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio's "Failed to bind": the port was taken after the check at start-up
        port = 0
    if port == 0:
        raise ConfigError("server.port", f"cannot listen on {address}")
    await server.start()
    return server, port
