"""The router as a Ray Serve deployment. Its methods are named exactly as the proto RPCs, so it serves behind Serve's
own gRPC proxy (`serve deploy` with our servicer functions) and behind expertmesh's gRPC front (which calls these
methods through a Serve handle, see grpc_front.py) alike.

Errors: a known failure becomes an ApiError with a gRPC code. Behind Serve's proxy the code is set on the
grpc_context and then raised (a streaming method must raise after set_code, or the code can be lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from dataclasses import asdict

import grpc
import ray
import torch
from ray import serve

from ..cluster.mesh_store import cluster_store
from ..cluster.naming import DEFAULT_MESH_ID, parse_expert_actor_name
from ..cluster.pool_spec import PoolSpec
from ..cluster.shard_liveness import HealthVerdict, health_verdict
from ..cluster.table_store import read_table
from ..experts.gil_handoff import shorten_gil_switch_interval
from ..experts.load_progress import read_progress
from ..experts.telemetry import carrier_from_metadata
from ..experts.token_compare import bearer_matches
from ..protos import admin_pb2
from ..protos import inference_pb2 as pb
from ..protos import kserve_v2_pb2 as kpb
from . import health, openai_generation, openai_requests, proto_mapping, tool_calls
from .admin_auth import admin_denial
from .batching import ContinuousBatcher, DoneEvent, QueueFullError
from .chat_template import load_chat_template
from .config import MeshConfig
from .dispatch import NoReplicaError
from .error_log import ClientErrorLog, quiet_serve_request_logs
from .errors import RequestError, check_token_ids
from .event_batches import batched_events
from .expert_pool import connect_actors
from .grammar_mask import grammar_tokenizer
from .prefetch import prefetch_gauge, prefetch_note
from .proto_mapping import ApiError
from .router import Router
from .startup import start_mesh

log = logging.getLogger(__name__)
SERVER_NAME = "expertmesh"
SERVER_VERSION = "0.1.0"
# What Serve's by-value hop (front -> replica over Serve's replica gRPC server) adds to a request: Serve's own
# metadata and pickling around the message.
HOP_OVERHEAD_BYTES = 1 << 20
_errors = ClientErrorLog()  # one line per refused request, rate-limited (router_service/error_log.py)
MAX_ACTOR_NAME_CHARS = 256  # actor names are short (expert-e12-r3); longer ones are refused unread
HEALTH_CACHE_S = 0.5  # health checks (every Watch stream polls) reuse a verdict this young
CONTROLLER_ASK_S = 2.0  # the controller's liveness view, or the router's own without it
# A non-streamed OpenAI generation's events cross to the front at most this long after the first of a batch: the
# client sees nothing before the end, and the front's resume point stays this fresh (router_service/event_batches.py).
NON_STREAMED_HOLD_S = 0.5


async def _rewritten(events, special: tool_calls.SpecialText):
    """A generation's events with special-token text rewritten (tool-call families whose markers are special)."""
    async with contextlib.aclosing(events) as events:
        async for event in events:
            yield special.rewrite(event)


def pool_spec_from_dict(pool: dict) -> PoolSpec:
    """A PoolSpec from the plain dict Serve ships to a router replica (shards as lists after a YAML/JSON trip)."""
    spec = PoolSpec(model_dir=pool["model_dir"], dtype=pool["dtype"], actor_shards={}, revision=pool.get("revision"),
                    tracing=pool.get("tracing"), memory_gb=pool.get("memory_gb"),
                    eviction=pool.get("eviction", "layer-cycle"), quant=pool.get("quant", "none"),
                    gpu_without_cuda=pool.get("gpu_without_cuda", "refuse"),
                    mesh_id=pool.get("mesh_id", DEFAULT_MESH_ID))
    return spec.with_actor_shards(pool["actor_shards"])


def _set_status(grpc_context, error: ApiError, method: str = "request") -> ApiError:
    _errors.log(method, error)
    if grpc_context is not None:
        grpc_context.set_code(getattr(grpc.StatusCode, error.code))
        grpc_context.set_details(error.message)
    return error


def _classify(exc: BaseException) -> ApiError:
    known = proto_mapping.as_api_error(exc)
    if known is not None:
        return known
    if isinstance(exc, NoReplicaError):
        return ApiError("UNAVAILABLE", str(exc))
    if isinstance(exc, QueueFullError):
        return ApiError("RESOURCE_EXHAUSTED", f"server busy: {exc}; retry later")
    if isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError):
        return ApiError("UNAVAILABLE", f"an expert actor is unavailable: {type(exc).__name__}")
    log.exception("unexpected error")
    return ApiError("INTERNAL", f"internal error ({type(exc).__name__}); see the router's log")


def router_options(config: MeshConfig) -> dict:
    """Serve options of the router deployment: replicas or autoscaling (router section), and the request size
    Serve's replica gRPC server takes.

    The front calls streaming methods by value, over Serve's inter-deployment gRPC, whose replica server keeps gRPC's
    4 MiB receive default unless RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH is set in the replica's environment (Ray
    2.60 reads it when the replica starts). Set here from server.max_message_bytes, so every request the front
    accepts also crosses the hop; nothing for the user to export.
    """
    hop_limit = config.server.max_message_bytes + HOP_OVERHEAD_BYTES
    env = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(hop_limit)}
    actor_options = config.router.replica_resources() | {"runtime_env": {"env_vars": env}}
    return config.router.deployment_options() | {"ray_actor_options": actor_options}


def replica_threads(configured: int | None, assigned_cpus: float) -> int:
    """torch threads of a router replica: router.threads, else the CPUs Ray assigned it (at least 1)."""
    return configured if configured is not None else max(1, int(assigned_cpus))


@serve.deployment(name="router", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class RouterDeployment:
    def __init__(self, config: dict, pool: dict):
        """config: the MeshConfig tree as a dict (router_service/config.py); pool: the running expert pool's
        PoolSpec as a dict. Plain data, so Serve ships it and a Serve YAML's builder produces it."""
        self.config = MeshConfig.from_dict(config)
        shorten_gil_switch_interval()  # the forward thread's many short socket calls (experts/gil_handoff.py)
        assigned = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
        torch.set_num_threads(replica_threads(self.config.router.threads, assigned))
        spec = pool_spec_from_dict(pool)
        published = read_table(spec.mesh_id)
        if published is not None:
            # A router replica started (or restarted by Serve) after a remap starts from the live placement.
            spec = spec.with_actor_shards(published["actor_shards"])
        self.router = Router(spec, connect_actors(spec), self.config,
                             router_id=serve.get_replica_context().replica_id.unique_id)
        self.cfg = self.router.model_config
        decode = self.router.decode if self.router.tokenizer is not None else None
        self.batcher = ContinuousBatcher(self.router.model, decode, self.config.router.batcher)
        self.batcher.observer = self.router.observer
        self.batcher.profile = self.router.profile
        self.router.observer.batcher_gauges = self._batcher_gauges
        self.model_name = self.config.model.served_name
        self.max_response_bytes = self.config.server.max_response_bytes
        quiet_serve_request_logs()
        # Every shard the model has, whatever the published table still names (a drained shard drops out of it).
        self.shards = [(layer, e) for layer in self.cfg.moe_layers for e in range(self.cfg.num_experts)]
        self._verdict: tuple[float, HealthVerdict] | None = None
        self._controller = None  # cached handle; dropped when a call to it fails
        try:
            # the reader's folder: for a Hub repo id, the snapshot holding tokenizer_config.json
            self.chat_template = load_chat_template(self.router.reader.model_dir)  # None: chat requests get a 400
        except (OSError, ValueError) as exc:  # an unreadable tokenizer_config.json must not stop the server
            log.warning("no chat template: cannot read tokenizer_config.json (%s)", exc)
            self.chat_template = None
        self._grammar_tokenizer = None  # llguidance's tokenizer, built on the first structured-output request
        self._grammar_lock = threading.Lock()

    def _special_tokens(self) -> dict[str, int]:
        """The tokenizer's special tokens, text -> id (a forced tool call names its markers by id)."""
        if self.router.tokenizer is None:
            return {}
        return {t.content: i for i, t in self.router.tokenizer.get_added_tokens_decoder().items() if t.special}

    def _llg_tokenizer(self):
        """llguidance's view of the model's tokenizer (~1 s to build, so once, on first use, off the event loop)."""
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = grammar_tokenizer(self.router.tokenizer.to_str(), self.cfg.vocab_size,
                                                            self.cfg.eos_token_id)
            return self._grammar_tokenizer

    def _authorize(self, grpc_context) -> None:
        token = self.config.server.auth_token
        if token is None or grpc_context is None:
            return  # no auth, or called through a handle from inside the cluster (the front checked it)
        metadata = dict(grpc_context.invocation_metadata())
        if not bearer_matches(metadata.get("authorization"), token):
            raise _set_status(grpc_context, ApiError("UNAUTHENTICATED", "missing or wrong bearer token"))

    def _authorize_admin(self, grpc_context) -> None:
        """Destructive Admin calls: the bearer rule, then the admin token (router_service/admin_auth.py)."""
        self._authorize(grpc_context)
        if grpc_context is None:
            return  # through a handle: the gRPC front checked the admin token
        denied = admin_denial(self.config.server.admin_token, dict(grpc_context.invocation_metadata()))
        if denied is not None:
            raise _set_status(grpc_context, ApiError("PERMISSION_DENIED", denied))

    # ---- expertmesh.v1.Inference -----------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None,  # noqa: N802 (proto method name)
                       trace: dict[str, str] | None = None):
        """trace: W3C carrier from expertmesh's gRPC front; behind Serve's proxy it comes from grpc_context."""
        if trace is None and grpc_context is not None:
            trace = carrier_from_metadata(grpc_context.invocation_metadata())
        span = self.router.observer.start_request(trace, rpc="Generate")
        try:
            self._authorize(grpc_context)
            # In a thread: tokenizing (bounded by the prompt-size check, and without the GIL) must not hold up the
            # event loop that feeds every other stream's tokens.
            gen_request = await asyncio.to_thread(proto_mapping.generation_request, request, self.cfg,
                                                  self.router.encode, self.model_name)
            # Closed explicitly: Serve cancels by throwing CancelledError in at this generator's `yield`, which a
            # bare `async for` would leave with the batcher's stream suspended, freed only when garbage collection
            # got to it.
            async with contextlib.aclosing(self.batcher.stream(gen_request, span=span)) as events:
                async for event in events:
                    converting = time.perf_counter()
                    if isinstance(event, DoneEvent):
                        message = proto_mapping.done_message(event)
                    else:
                        message = proto_mapping.token_message(event)
                    self.router.profile.since("serve.emit", converting)
                    yield message
        except asyncio.CancelledError:
            raise  # client cancel or deadline: closing batcher.stream (above) frees the sequence
        except Exception as exc:
            raise _set_status(grpc_context, _classify(exc), "Generate") from None
        finally:
            if span is not None:
                span.end()

    async def OpenAIGenerate(self, job):  # noqa: N802 (named like the RPCs it sits with)
        """The OpenAI HTTP API's generation (router_service/http_front.py): job is an openai_api.OpenAIJob; streams
        one plain dict per event (router_service/openai_responses.py), each naming its choice index. Same batcher,
        same cancel path as Generate: the HTTP front cancelling this call (client disconnect) closes the batcher
        streams, which frees the sequences. n / best_of / a batch of prompts run as several sequences of the same
        batcher (router_service/choice_streams.py); echo scores the prompt with Score's forward."""
        span = self.router.observer.start_request(None, rpc="OpenAIGenerate")
        try:
            plan = await asyncio.to_thread(
                openai_requests.plan, job, self.cfg, self.router.encode, self._encode_rendered, self.chat_template,
                self._llg_tokenizer if self.router.tokenizer is not None else None, self._special_tokens)
            events = openai_generation.job_events(
                job, plan, stream=lambda request: self.batcher.stream(request, span=span),
                score=lambda ids: self.batcher.run_exclusive(lambda: self.router.score_batch(ids)),
                decode=self.router.decode, token_text=self._token_text)
            special = None
            if plan.tool_family in tool_calls.SPECIAL_FAMILIES and self.router.tokenizer is not None:
                tokenizer = self.router.tokenizer
                special = tool_calls.SpecialText(lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                                                 self.cfg.eos_token_id, job.resumed)
            if special is not None:
                events = _rewritten(events, special)
            # Batched: one Serve stream item per ready batch, not per token (router_service/event_batches.py).
            async for batch in batched_events(events, 0.0 if job.stream else NON_STREAMED_HOLD_S):
                yield batch
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _set_status(None, _classify(exc), "OpenAIGenerate") from None
        finally:
            if span is not None:
                span.end()

    async def OpenAITokenize(self, text: str | None, messages: list[dict] | None) -> list[int]:  # noqa: N802
        """/tokenize: a prompt's ids as /v1/completions would encode it, or chat messages' rendered prompt's."""
        try:
            if messages is not None:
                if self.chat_template is None:
                    raise RequestError("messages", "this model's checkpoint has no chat template")
                return self._encode_rendered(self.chat_template.render(messages, add_generation_prompt=True))
            return await asyncio.to_thread(self.router.encode, text)
        except Exception as exc:
            raise _set_status(None, _classify(exc), "OpenAITokenize") from None

    async def served_model_name(self) -> str:
        """The name clients use for the model (`expertmesh front` asks, so its HTTP front checks the same one)."""
        return self.model_name

    async def context_length(self) -> int:
        """The model's context (max_position_embeddings), for /tokenize's max_model_len."""
        return self.cfg.max_position_embeddings

    async def OpenAIDetokenize(self, ids: list[int]) -> str:  # noqa: N802
        """/detokenize: token ids -> text (ids outside the vocabulary refused, naming `tokens`)."""
        try:
            check_token_ids(ids, self.cfg.vocab_size, len(ids), "tokens")  # any length: no context here
            text = self.router.decode(ids)
            if text is None:
                raise RequestError("tokens", "this model's checkpoint has no tokenizer.json")
            return text
        except Exception as exc:
            raise _set_status(None, _classify(exc), "OpenAIDetokenize") from None

    def _encode_rendered(self, text: str) -> list[int]:
        if self.router.tokenizer is None:
            return self.router.encode(text)  # raises the no-tokenizer error
        return self.router.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def _token_text(self, token_id: int) -> str:
        return self.router.decode([token_id]) or ""

    async def Score(self, request: pb.ScoreRequest, grpc_context=None) -> pb.ScoreResponse:  # noqa: N802
        try:
            self._authorize(grpc_context)
            ids = proto_mapping.score_ids(request, self.cfg, self.model_name)
            proto_mapping.check_logits_fit(1, len(ids), self.cfg.vocab_size, self.max_response_bytes, "token_ids")
            logits = await self.batcher.run_exclusive(lambda: self.router.score(ids))
            return proto_mapping.score_message(logits, request.log_probs)
        except Exception as exc:
            raise _set_status(grpc_context, _classify(exc), "Score") from None

    # ---- inference.GRPCInferenceService (KServe v2) ----------------------------------------------------------

    async def ServerLive(self, request, grpc_context=None):  # noqa: N802
        return kpb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, grpc_context=None):  # noqa: N802
        return kpb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, grpc_context=None):  # noqa: N802
        try:
            proto_mapping.check_model_name(request.name, self.model_name, field="name")
        except ApiError as exc:
            raise _set_status(grpc_context, exc, "ModelReady") from None
        return kpb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request, grpc_context=None):  # noqa: N802
        return kpb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=[])

    async def ModelMetadata(self, request, grpc_context=None):  # noqa: N802
        try:
            proto_mapping.check_model_name(request.name, self.model_name, field="name")
        except ApiError as exc:
            raise _set_status(grpc_context, exc, "ModelMetadata") from None
        return proto_mapping.model_metadata(self.model_name, self.cfg)

    async def ModelInfer(self, request, grpc_context=None):  # noqa: N802
        try:
            self._authorize(grpc_context)
            ids = proto_mapping.infer_input(request, self.cfg, self.model_name)  # [batch, seq]
            proto_mapping.check_logits_fit(*ids.shape, self.cfg.vocab_size, self.max_response_bytes,
                                           f"inputs[{proto_mapping.INPUT_NAME}].shape")
            rows = [row.tolist() for row in ids]
            logits = await self.batcher.run_exclusive(lambda: self.router.score_batch(rows))
            out = torch.stack(logits).to("cpu", torch.float32).numpy()  # [batch, seq, vocab], off the device
            return proto_mapping.infer_response(request, self.model_name, out)
        except Exception as exc:
            raise _set_status(grpc_context, _classify(exc), "ModelInfer") from None

    # ---- grpc.health.v1.Health -------------------------------------------------------------------------------

    async def Check(self, request, grpc_context=None):  # noqa: N802
        if not health.known_service(request.service):
            message = f"service: unknown service {request.service[:200]!r}"
            raise _set_status(grpc_context, ApiError("NOT_FOUND", message))
        return health.response(await self._health_status())

    async def Watch(self, request, grpc_context=None):  # noqa: N802
        async for message in health.watch(request.service, self._health_status):
            yield message

    async def _health_status(self) -> int:
        verdict = await self.health_verdict()
        return health.SERVING if verdict.serving else health.NOT_SERVING

    async def health_verdict(self) -> HealthVerdict:
        """Can this router answer every request now? NOT serving while a shard has no live replica and the
        no-replica policy cannot serve it (cluster/shard_liveness.py). Down actors: the controller's view (drained,
        lost, restoring; it probes every actor every check_interval_s) when it answers, else this router's own
        (actors its calls found dead)."""
        now = time.monotonic()
        if self._verdict is not None and now - self._verdict[0] < HEALTH_CACHE_S:
            return self._verdict[1]
        down = await self._controller_down()
        if down is None:
            down = set(self.router.backend.dead)
        verdict = health_verdict(self.shards, self.router.table.replicas, down,
                                 self.router.backend.failover.no_replica_policy)
        if self._verdict is not None and self._verdict[1].serving != verdict.serving:
            log.warning("health: %s (%s)", "SERVING" if verdict.serving else "NOT_SERVING", verdict.reason)
        self._verdict = (now, verdict)
        return verdict

    async def _controller_down(self) -> set[str] | None:
        try:
            if self._controller is None:
                names = self.router.spec.names
                self._controller = ray.get_actor(names.controller, namespace=names.namespace)
            liveness = await asyncio.wait_for(self._controller.liveness.remote(), timeout=CONTROLLER_ASK_S)
            return set(liveness["down"])
        except Exception:  # no controller (--no-controller), restarting, or slow: fall back on the router's view
            self._controller = None
            return None

    # ---- expertmesh.v1.Admin ---------------------------------------------------------------------------------

    async def GetRouterStats(self, request, grpc_context=None):  # noqa: N802
        self._authorize(grpc_context)
        return self._router_stats()

    def _router_stats(self) -> admin_pb2.RouterStats:
        s = self.batcher.stats()
        backend = self.router.backend
        return admin_pb2.RouterStats(
            live_kv_caches=s["live_caches"], active_sequences=s["active"], waiting_requests=s["waiting"],
            steps=s["steps"], max_batch_seen=s["max_batch_seen"],
            replica=serve.get_replica_context().replica_id.unique_id,
            retried_calls=backend.retried_calls, degraded_slots=backend.degraded_slots, shed_slots=backend.shed_slots,
            load_json=json.dumps(self.router.load_snapshot()),
            dtype=self.router.dtype_name, device=str(self.router.device), threads=torch.get_num_threads(),
            preemptions=s.get("preemptions", 0), kv_blocks_free=s.get("kv_blocks_free", 0),
            kv_blocks_total=s.get("kv_blocks_total", 0), stage_seconds=self.router.profile.snapshot(),
            prefix_query_tokens=s.get("prefix_query_tokens", 0), prefix_hit_tokens=s.get("prefix_hit_tokens", 0),
            kv_blocks_cached=s.get("kv_blocks_cached", 0), expert_shard_calls=s.get("expert_shard_calls", 0),
            finished_requests=s.get("finished_requests", 0), cuda_graphs=self.router.graphs_note,
            cuda_graph_buckets=s.get("cuda_graph_buckets", 0), cuda_graph_replays=s.get("cuda_graph_replays", 0),
            cuda_graph_captures=s.get("cuda_graph_captures", 0),
            cuda_graph_failed_buckets=s.get("cuda_graph_failed_buckets", 0),
            prefetch=prefetch_note(backend.prefetcher),
        )

    def _batcher_gauges(self) -> dict:
        s = self.batcher.stats()
        hints = prefetch_gauge(self.router.backend.prefetcher)
        return {**({} if hints is None else {"expertmesh_prefetch_hints": hints}),
                "expertmesh_queue_depth": s["waiting"], "expertmesh_active_sequences": s["active"],
                "expertmesh_kv_cache_sequences": s["live_caches"],
                "expertmesh_kv_cache_bytes": self.batcher.kv_cache_bytes(),
                "expertmesh_kv_blocks_free": s.get("kv_blocks_free", 0),
                "expertmesh_kv_blocks_total": s.get("kv_blocks_total", 0),
                "expertmesh_kv_blocks_cached": s.get("kv_blocks_cached", 0),
                "expertmesh_prefix_cache_hit_rate":
                    s.get("prefix_hit_tokens", 0) / max(1, s.get("prefix_query_tokens", 0)),
                "expertmesh_expert_shards_per_request":
                    s.get("expert_shard_calls", 0) / max(1, s.get("finished_requests", 0))}

    async def load_snapshot(self) -> dict:
        """This replica's load statistics (plain dict; README: Load statistics)."""
        return self.router.load_snapshot()

    async def GetClusterState(self, request, grpc_context=None):  # noqa: N802
        self._authorize(grpc_context)
        return await cluster_state(self.router, self._router_stats(), self.model_name)

    async def KillReplica(self, request, grpc_context=None):  # noqa: N802
        self._authorize_admin(grpc_context)
        return await self._replica_action("kill_replica", grpc_context, request.actor, force=request.force)

    async def DrainReplica(self, request, grpc_context=None):  # noqa: N802
        self._authorize_admin(grpc_context)
        return await self._replica_action("drain_replica", grpc_context, request.actor, force=request.force)

    async def UndrainReplica(self, request, grpc_context=None):  # noqa: N802
        self._authorize_admin(grpc_context)
        # Starting a stopped replica again loads its weights: allow for the controller's restore timeout.
        return await self._replica_action("undrain_replica", grpc_context, request.actor, timeout_s=300.0)

    async def _replica_action(self, method: str, grpc_context, actor: str, timeout_s: float = 10.0,
                              **options) -> admin_pb2.ReplicaReply:
        """Ask the controller (it alone knows which replicas are live, drained or restoring); its refusal becomes
        the call's status: NOT_FOUND, FAILED_PRECONDITION (the last live replica of a shard), UNAVAILABLE."""
        if len(actor) > MAX_ACTOR_NAME_CHARS:  # no actor has such a name; do not echo it whole in the status
            raise _set_status(grpc_context, ApiError("NOT_FOUND", "actor: no expert replica named "
                                                                  f"{proto_mapping.shown(actor)}"))
        try:
            names = self.router.spec.names
            controller = ray.get_actor(names.controller, namespace=names.namespace)
            outcome = await asyncio.wait_for(getattr(controller, method).remote(actor, **options), timeout=timeout_s)
        except Exception as exc:
            raise _set_status(grpc_context, ApiError("UNAVAILABLE", f"controller unavailable: {exc}")) from None
        if outcome["code"] != "OK":
            raise _set_status(grpc_context, ApiError(outcome["code"], outcome["message"]))
        self._verdict = None  # the next health check sees the change at once
        return admin_pb2.ReplicaReply(ok=True, message=outcome["message"])


async def cluster_state(router: Router, stats: admin_pb2.RouterStats, model_name: str) -> admin_pb2.ClusterState:
    """Controller view (epoch, events, restores) + each actor's own report + this router's breakers."""
    state = admin_pb2.ClusterState(model=model_name, router=stats,
                                   no_replica_policy=router.backend.failover.no_replica_policy)
    controller_state: dict = {}
    mesh = router.spec.names  # this router's mesh: its controller, actors and progress keys
    try:
        controller = ray.get_actor(mesh.controller, namespace=mesh.namespace)
        controller_state = await asyncio.wait_for(controller.get_state.remote(), timeout=5)
        state.controller_alive = True
    except Exception:
        state.controller_alive = False
    state.epoch = controller_state.get("epoch", 0)
    merged = None
    if state.controller_alive:
        try:
            merged = await asyncio.wait_for(controller.load.remote(), timeout=5)
        except Exception:  # an older controller without load reports, or a slow one: show this router's
            merged = None
    state.load_json = json.dumps(merged) if merged is not None else stats.load_json
    state.control_json = json.dumps(controller_state.get("control", []))
    state.requested_gpus = int(controller_state.get("requested_gpus", 0))
    state.placement_claims = int(controller_state.get("claims", {}).get("live", 0))
    drained = set(controller_state.get("drained", []))
    restoring = {n for n, a in controller_state.get("actors", {}).items() if a.get("restoring")}

    async def info(name: str) -> dict | None:
        try:
            handle = ray.get_actor(name, namespace=mesh.namespace)
            return await asyncio.wait_for(handle.info.remote(), timeout=3)
        except Exception:
            return None

    # Drained replicas have left the routing table; list them anyway, so an operator sees them (and can undrain).
    names = list(router.table.actors) + sorted(drained - set(router.table.actors))
    infos = await asyncio.gather(*(info(n) for n in names))
    for name, got in zip(names, infos):
        try:
            expert, replica = parse_expert_actor_name(name)
        except ValueError:  # an actor a remap added with a mixed set of shards: no single expert id
            expert, replica = -1, -1
        replica_state = admin_pb2.ReplicaState(
            # A replica the controller is still restoring is not serving yet, even if its new actor answers.
            actor=name, expert=expert, replica=replica, alive=got is not None and name not in restoring,
            restoring=name in restoring,
            breaker=router.backend.breakers.get(name).state, drained=name in drained,
        )
        progress = read_progress(name, cluster_store().get_key, mesh.mesh_id)
        if progress is not None:
            replica_state.load_bytes = progress.loaded_bytes
            replica_state.load_total_bytes = progress.total_bytes
            replica_state.load_error = progress.error or ""
        if got is not None:
            replica_state.node_id = got["node_id"]
            replica_state.gpu_ids.extend(got["gpu_ids"])
            replica_state.device = got["device"]
            replica_state.dtype = got.get("dtype", "")
            replica_state.generation = got["generation"]
            replica_state.calls = got["calls"]
            replica_state.tokens = got["tokens"]
            replica_state.tiers_json = json.dumps(got["tiers"]) if got.get("tiers") else ""
            replica_state.compute_s = got.get("compute_s", 0.0)
        state.replicas.append(replica_state)
    for (layer, expert), replicas in sorted(router.table.replicas.items()):
        state.shards.append(admin_pb2.ShardReplicas(layer=layer, expert=expert, replicas=list(replicas)))
    for event in controller_state.get("events", [])[-200:]:
        detail = {k: v for k, v in event.items() if k not in ("t", "kind", "actor")}
        state.events.append(admin_pb2.ClusterEvent(time=event["t"], kind=event["kind"], actor=event["actor"],
                                                   detail_json=json.dumps(detail)))
    return state


def build_app(args: dict) -> serve.Application:
    """Serve import path `expertmesh.router_service.deployment:build_app` (cluster/configs/serve_config.yaml).

    args: the MeshConfig tree as a dict (the same keys as `expertmesh serve --config FILE`; unknown keys are refused
    by name). Starts -- or adopts, on a redeploy -- the expert actors and the controller through the one start-up
    path, detached so they outlive this builder, then returns the router deployment with router.replicas /
    router.autoscale as its Serve options. Serve's own gRPC proxy serves it; `server.auth_token` is checked there.
    """
    config = MeshConfig.from_dict(args).validate()
    runtime = start_mesh(config, detached=True, reuse=True)
    return RouterDeployment.options(**router_options(config)).bind(config.to_dict(),
                                                                             asdict(runtime.spec))
