"""The router: dense model + gates in this process, routed experts in a pool of actors.

It validates requests (a bad field raises `RequestError` naming it) and answers `score` and greedy `generate`.
The Serve deployment and the in-process `ExpertMesh` both wrap this class.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace

import ray
import torch

from ..cluster.overlap_policy import StepOverlapPolicy, runtime_profile
from ..cluster.pool_spec import PoolSpec
from ..cluster.routing_table import RoutingTable
from ..experts.checkpoint import CheckpointReader
from ..experts.decode_graphs import GraphSettings, graph_buckets, model_reason
from ..experts.devices import compute_device, gpus_given
from ..experts.dtypes import read_checkpoint_dtype, resolve_dtype, torch_dtype
from ..experts.kv_cache import blocks_for, settings_for
from ..experts.model_source import dense_tensors, open_checkpoint
from ..experts.modeling import MoEDecoder
from ..experts.telemetry import build_tracer
from ..experts.tokenizer import load_tokenizer
from ..experts.weights import load_dense_weights
from .config import MeshConfig
from .dispatch import RemoteExperts
from .errors import RequestError, check_budget, check_token_ids
from .node_watch import NodeWatch
from .observability import RouterObserver, default_router_id
from .prefetch import NextLayerPredictor
from .table_sync import TableFollower
from .transports.base import resolve_transport
from .transports.factory import close_transport, make_transport
from .transports.refs import NameReviver

__all__ = ["Router", "Generation", "RequestError", "router_device"]
log = logging.getLogger(__name__)


def router_device(gpus: float, cuda_available: bool, policy: str = "refuse", gpu_ids: list | None = None
                  ) -> torch.device:
    """Where a router computes: the CPU when it asked for no GPU (router.gpus 0); cuda:0 when it did and sees one
    (in a Serve replica Ray sets CUDA_VISIBLE_DEVICES to what it assigned, so cuda:0 is that GPU). Asked for one but
    torch sees no CUDA: ConfigError naming devices.gpu_without_cuda (one line, experts/devices.py), or the CPU when
    policy is "cpu". gpu_ids: what Ray gave a Serve replica (an in-process router is given none, it only asks)."""
    if gpus <= 0:
        return torch.device("cpu")
    given = gpus_given(gpu_ids or []) or f"asks for router.gpus {gpus:g}"
    who = "router replica" if gpu_ids else "router"
    if not cuda_available and policy == "cpu":
        log.warning("%s %s, but torch sees no CUDA: computing on the CPU (devices.gpu_without_cuda: cpu)", who, given)
    return torch.device(compute_device(who, given, cuda_available, policy, torch.__version__, torch.version.cuda,
                                       os.environ.get("CUDA_VISIBLE_DEVICES")))


def _ray_gpu_ids() -> list:
    """The GPUs Ray assigned this process when it is an actor (a Serve replica); none for a driver."""
    try:
        return list(ray.get_gpu_ids()) if ray.get_runtime_context().get_actor_id() is not None else []
    except Exception:  # noqa: BLE001 - Ray not initialised: an in-process router without a cluster
        return []


@dataclass
class Generation:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "length" | "eos"
    tokens_per_expert: dict[int, list[int]] = field(default_factory=dict)  # layer -> [E] routed slots


class Router:
    def __init__(self, spec: PoolSpec, actors: dict[str, ray.actor.ActorHandle], config: MeshConfig,
                 reader: CheckpointReader | None = None, router_id: str | None = None):
        """spec/actors: the running expert pool; config: the mesh's settings (router, failover, observability and
        tracing sections are read here); router_id: names this router in load reports (a Serve replica's id)."""
        self.spec = spec
        # First: a replica Ray gave a GPU that torch cannot see refuses before it reads or connects anything.
        self.device = router_device(config.router.gpus, torch.cuda.is_available(), config.devices.gpu_without_cuda,
                                    _ray_gpu_ids())
        self.reader = reader or open_checkpoint(spec.model_dir, spec.revision, dense_tensors)
        self.model_config = self.reader.config
        self.tokenizer = load_tokenizer(self.reader.model_dir)
        self.config = config
        settings = config.router
        self.transport_name = resolve_transport(settings.transport, config.ray.address)
        self.transport = make_transport(self.transport_name, dict(actors), device=self.device)
        self.backend = RemoteExperts(RoutingTable.from_actor_shards(spec.actor_shards), self.transport,
                                     config.failover, reviver=NameReviver(self.transport, spec.names.namespace))
        # Node loss from Ray's node table (router_service/node_watch.py): replicas on a dead node are dead at once
        # and calls in flight to them are given up on (refs, socket and grpc transports) and retried elsewhere.
        self.node_watch = None
        if config.failover.node_poll_s > 0 and ray.is_initialized():
            self.node_watch = NodeWatch(self.transport.actors, config.failover.node_poll_s)
            if hasattr(self.transport, "lost"):
                self.transport.lost = self.node_watch.lost
            self.backend.node_watch = self.node_watch.start()
        # Dense weights, KV cache and sampling live on self.device; only rows for expert actors leave it.
        self.dtype_name = resolve_dtype(spec.dtype, read_checkpoint_dtype(self.reader.model_dir),
                                        self.device.type == "cuda")
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        dense = load_dense_weights(self.reader, torch_dtype(self.dtype_name), progress="router weights",
                                   device=self.device)
        log.info("router: %s weights on %s, %d torch threads (model.dtype %s)", self.dtype_name, self.device,
                 torch.get_num_threads(), spec.dtype)
        # A linear-attention model's state slots: one per sequence the batcher runs at once (experts/state_cache.py)
        kv_cache = settings_for(dense.embed.device, settings.kv_cache_gb, settings.gpu_memory_utilization,
                                settings.kv_block_size, settings.prefix_caching,
                                state_slots=settings.batcher.max_active)
        graphs = self._graph_setting(settings)
        self.model = MoEDecoder(self.model_config, dense, self.backend, settings.capacity_factor,
                                overlap=self._overlap_setting(settings, len(spec.actor_shards), graphs is not None),
                                kv_cache=kv_cache, cuda_graphs=graphs)
        prefetch = config.experts.prefetch_mode(self.transport_name)
        if prefetch != "off":  # README: Offload
            self.backend.prefetcher = NextLayerPredictor(
                prefetch, self.model_config.moe_layers, self.model.predict_experts,
                policy=config.experts.prefetch_policy(), gate_probs=self.model.predict_expert_probs,
                top_k=self.model_config.top_k, governor=config.experts.prefetch_governor())
        # Load statistics, metrics, traces (router_service/observability.py).
        self.observer = RouterObserver(self.model_config, self.backend, router_id or default_router_id(),
                                       config.observability, build_tracer(config.tracing, "router"),
                                       mesh_id=spec.mesh_id)
        self.enable_tracing(self.observer.tracer)
        self.backend.observer = self.observer
        self.model.step_observer = self.observer.on_step
        # One stage clock for the decoder and the dispatcher (and the Serve deployment's batcher): Admin
        # GetRouterStats reports it (router_service/step_profile.py).
        self.profile = self.backend.profile
        self.model.profile = self.profile
        self.observer.start_reporter()
        # Follow the placement the controller publishes (live remap); switches happen between steps.
        self.follower = TableFollower(self.backend, self.observer.router_id, mesh_id=spec.mesh_id).start()

    def _graph_setting(self, settings) -> GraphSettings | None:
        """router.cuda_graphs as the decoder takes it: "on" needs a router on a GPU and a model whose decode step can
        be graphed (else one error naming both the field and the reason); "auto" is on where both hold."""
        self.graphs_note = "off"  # what RouterStats.cuda_graphs says (expertmesh status)
        if settings.cuda_graphs == "off":
            return None
        reason = (f"the router computes on {self.device}" if self.device.type != "cuda"
                  else model_reason(self.model_config, settings.capacity_factor))
        if reason is not None:
            if settings.cuda_graphs == "on":
                raise ValueError(f"router.cuda_graphs: on, but {reason}")
            log.info("router: cuda_graphs auto -> off (%s)", reason)
            self.graphs_note = f"off ({reason})"
            return None
        log.info("router: decode steps of up to %d sequences replay CUDA graphs", settings.cuda_graph_max_batch)
        self.graphs_note = f"on (decode batches up to {settings.cuda_graph_max_batch})"
        return GraphSettings(buckets=graph_buckets(settings.cuda_graph_max_batch))

    def _overlap_setting(self, settings, actors: int, graphs: bool = False):
        """router.overlap as the decoder takes it: True / False, or for "auto" the latency model's per-step choice
        (cluster/overlap_policy.py: off on a CPU, off with a capacity factor, off on a GPU it has no profile of)."""
        if settings.overlap != "auto":
            return settings.overlap
        if settings.capacity_factor is not None:
            return False
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        profile = runtime_profile(self.model_config, self.device.type, name, self.transport_name, actors)
        if profile is None:
            log.info("router: overlap auto -> off (no latency profile for %s / %s)", name, self.transport_name)
            return False
        if not graphs:  # the plain step it weighs two micro-batches against runs eagerly too
            profile = replace(profile, hardware=replace(profile.hardware, graph_launch_s=None))
        return StepOverlapPolicy(profile)

    @property
    def table(self):
        """The routing table this router uses now (it changes when the controller remaps)."""
        return self.backend.table

    def enable_tracing(self, tracer) -> None:
        """Trace with `tracer` (an OpenTelemetry tracer; None turns tracing off)."""
        self.observer.tracer = tracer
        self.backend.tracer = tracer

    def load_snapshot(self) -> dict:
        """This router's load statistics as a plain JSON-able dict (README: Load statistics)."""
        return self.observer.snapshot()

    def close(self) -> None:
        """Release the transport (a compiled graph's channels, gRPC channels); the actors stay up."""
        self.observer.stop()
        self.follower.stop()
        if self.node_watch is not None:
            self.node_watch.stop()
        close_transport(self.transport)

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("prompt", f"the checkpoint at {self.spec.model_dir} has no tokenizer.json; "
                                         "pass token ids instead")
        # encode_batch releases the GIL while it works (encode does not), so tokenizing a long prompt on a thread
        # leaves the replica's event loop, and every other stream, running.
        return self.tokenizer.encode_batch([prompt])[0].ids

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def check_token_ids(self, token_ids: list[int], field: str = "token_ids") -> torch.Tensor:
        cfg = self.model_config
        ids = check_token_ids(token_ids, cfg.vocab_size, cfg.max_position_embeddings, field)
        return torch.tensor(ids, dtype=torch.int64)  # host: the decoder sends a step's ids up without a wait

    def check_budget(self, prompt_len: int, max_tokens: int) -> None:
        check_budget(prompt_len, max_tokens, self.model_config.max_position_embeddings)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [S, V] (float32, host memory) for every position of `token_ids`."""
        return self.score_batch([token_ids])[0]

    def score_batch(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """Several sequences in one forward: every expert call of a layer serves all of them. -> per sequence
        logits [S_i, V], float32 in host memory (whatever the router's device and dtype)."""
        tokens = [self.check_token_ids(ids) for ids in batch]
        with self.observer.step_span([None] * len(tokens), sum(int(t.numel()) for t in tokens)):
            logits = self.model.forward(tokens)
        return [out.to("cpu", torch.float32) for out in logits]

    def generate(
        self, token_ids: list[int] | None = None, prompt: str | None = None, max_tokens: int = 32,
        stop_at_eos: bool = True, trace: dict[str, str] | None = None,
    ) -> Generation:
        """Greedy decoding with a KV cache: one forward for the prompt, then one per new token.
        trace: W3C carrier of the caller's span (with tracing on, the request span becomes its child)."""
        span = self.observer.start_request(trace, max_tokens=max_tokens)
        try:
            return self._generate(token_ids, prompt, max_tokens, stop_at_eos, span)
        finally:
            if span is not None:
                span.end()

    def _generate(self, token_ids, prompt, max_tokens, stop_at_eos, span) -> Generation:
        if (token_ids is None) == (prompt is None):
            raise RequestError("prompt", "give exactly one of prompt or token_ids")
        ids = self.encode(prompt) if prompt is not None else list(token_ids)
        tokens = self.check_token_ids(ids, "prompt" if prompt is not None else "token_ids")
        self.check_budget(len(ids), max_tokens)
        pool = self.model.kv_pool
        if blocks_for(len(ids) + max_tokens, pool.block_size) > pool.num_blocks:
            raise RequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) do not fit: "
                                             f"the KV cache holds at most {pool.capacity_tokens} tokens "
                                             "(router.kv_cache_gb)")
        cache = self.model.new_cache()
        eos = self.model_config.eos_token_id if stop_at_eos else None
        routed: dict[int, torch.Tensor] = {}
        try:
            out, finish = self._greedy(cache, tokens, max_tokens, eos, span, routed)
        finally:
            cache.free()  # the blocks go back to the pool whatever happened
        return Generation(
            token_ids=out, text=self.decode(out), finish_reason=finish,
            tokens_per_expert={layer: counts.tolist() for layer, counts in routed.items()},
        )

    def _greedy(self, cache, step_input, max_tokens, eos, span, routed) -> tuple[list[int], str]:
        """The decode loop of `generate`: lm_head on the last position only; routed slots added to `routed`."""
        out: list[int] = []
        finish = "length"
        for _ in range(max_tokens):
            with self.observer.step_span([span], int(step_input.numel())):
                logits = self.model.forward([step_input], [cache], logits="last")[0]  # [1, V]
            for layer, routing in self.model.last_trace.routings.items():
                counts = routing.tokens_per_expert(self.model_config.num_experts)
                routed[layer] = routed.get(layer, 0) + counts
            next_id = int(torch.argmax(logits[-1]))
            out.append(next_id)
            if eos is not None and next_id == eos:
                finish = "eos"
                break
            step_input = torch.tensor([next_id], dtype=torch.int64)
        return out, finish
