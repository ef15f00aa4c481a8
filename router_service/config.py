"""The configuration tree: every setting of a running expertmesh, in one place.

One `MeshConfig` is what the Python API (`ExpertMesh`), `expertmesh serve`, the Serve application builder (a Serve
YAML's `args`, a KubeRay RayService) and the drill all take; `start_mesh` (router_service/startup.py) starts
from it. Each section is a frozen dataclass; the ones that belong to a component live beside it (failover in
failover_config.py, batching in batching_config.py, the controller in cluster/controller_config.py, ...), the rest
here. Every module this one imports is free of torch, Ray and gRPC (tests/unit/test_pure_modules.py checks it), so
the CLI parses and checks a configuration before it loads any of them.

    model:          checkpoint folder, served name, dtype
    ray:            embedded Ray or the address of a cluster to join
    experts:        the expert pool: replicas, CPU share, start timeout, planned placement file
    router:         transport, overlap, capacity factor, threads, replicas (Serve), continuous batching
    devices:        what a process Ray gave GPUs does when torch sees no CUDA (refuse, or compute on the CPU)
    failover:       retries, breakers' timeouts, the no-replica policy
    controller:     restores, intervals, elasticity (rebalancing, autoscaling)
    observability:  load window, metrics
    tracing:        OpenTelemetry exporter
    server:         the gRPC front: host, port, TLS, bearer token, admin token, message size

It round-trips to and from a plain dict (`to_dict` / `from_dict`, unknown keys refused by name) and a YAML or JSON
file (`load`). `validate()` checks every section and the settings that depend on each other; the one error type,
`ConfigError`, names the field by its dotted path ("router.transport: must be one of ...").

Adding a setting: a field in its section's dataclass (with its check in that section's validate), a flag in
ops/commands/mesh_flags.py, and its use. Nothing else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..cluster.controller_config import ControllerConfig
from ..cluster.naming import DEFAULT_MESH_ID, mesh_id_problem
from ..experts.devices import DevicesConfig
from ..experts.embedded_model import EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_NAME
from ..experts.errors import ConfigError
from ..experts.repo_ids import is_repo_id, source_problem
from ..experts.setting_choices import DTYPE_CHOICES, EVICTION_POLICIES, PREFETCH_SETTINGS, QUANT_MODES
from ..experts.tracing_config import TracingConfig
from .batching_config import BatcherConfig
from .config_tree import from_dict, replace_path, to_dict, validate_tree
from .failover_config import FailoverConfig
from .observability_config import ObservabilityConfig
from .server_checks import check_can_listen, check_tls_pair
from .transports.base import TRANSPORT_SETTINGS

__all__ = ["MeshConfig", "ModelConfig", "MeshIdConfig", "RayConfig", "ExpertsConfig", "RouterConfig", "DevicesConfig",
           "ServerConfig", "ConfigError", "DTYPES"]

DTYPES = DTYPE_CHOICES  # "auto", "bfloat16", "float16", "float32" (experts/dtypes.py resolves "auto")
MAX_MESSAGE_BYTES = 1 << 30  # gRPC's limits are 32-bit; Serve's hop adds its own overhead to a request
MAX_JSON_DEPTH = 256  # well inside Python's recursion limit (1000), which json.loads recurses against
MIN_RESPONSE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ModelConfig:
    # A checkpoint folder (local, or shared storage mounted on every node) or a Hugging Face repo id ("org/name"),
    # fetched per node (experts/model_source.py); None: the embedded default model.
    path: str | None = None
    revision: str | None = None  # with a repo id: branch, tag or commit (default: the repo's main)
    # The name clients use; None: the folder's name or the repo id ("expertmesh-demo" for the embedded model).
    name: str | None = None
    # Weights and activations of the router and the experts. "auto": the checkpoint's dtype (config.json) in a
    # process that computes on a GPU, float32 on a CPU; resolved per process by experts/dtypes.py:resolve_dtype.
    dtype: str = "auto"

    def validate(self) -> ModelConfig:
        if self.path is not None and (problem := source_problem(self.path)) is not None:
            raise ValueError(f"path: {problem}")
        if self.revision is not None and (self.path is None or not is_repo_id(self.path)):
            raise ValueError("revision: applies to a Hugging Face repo id given as model.path, not to a folder")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {DTYPES}, got {self.dtype!r}")
        if self.name is not None and not self.name.strip():
            raise ValueError("name: must not be blank")
        return self

    @property
    def is_repo_id(self) -> bool:
        return self.path is not None and is_repo_id(self.path)

    @property
    def source(self) -> str:
        """What every process fetches the checkpoint from: an absolute folder or the repo id."""
        if self.is_repo_id:
            return self.path
        return str((Path(self.path) if self.path else EMBEDDED_MODEL_DIR).resolve())

    @property
    def resolved_path(self) -> Path:
        """The local folder (for a repo id: the Hub cache's snapshot after fetching config and tokenizer only)."""
        if self.is_repo_id:
            from ..experts.model_source import fetch_checkpoint  # the checkpoint readers (torch): only when fetching

            return fetch_checkpoint(self.path, self.revision, tensors=lambda cfg, keys: ())
        return Path(self.source)

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        if self.path is None:
            return EMBEDDED_MODEL_NAME
        return self.path if self.is_repo_id else Path(self.source).name


# An embedded Ray's GCS keeps the events of the last `task_events_max_num_task_in_gcs` tasks (Ray's default 100,000),
# and every Serve request and controller probe is a task: Ray's daemons grew 33 % over a 30-minute soak, and a
# 6-minute one showed it is the GCS (187 -> 402 MiB), still short of that cap. Nothing of expertmesh reads Ray's
# task history, so an embedded Ray keeps 10,000 (docs/operations/drills.md, the soak). A joined cluster's settings
# are its operator's.
EMBEDDED_RAY_SYSTEM_CONFIG = {"task_events_max_num_task_in_gcs": 10_000}



@dataclass(frozen=True)
class RayConfig:
    address: str = "local"  # "local" starts an embedded Ray; otherwise the address of a cluster to join
    num_cpus: int | None = None  # CPUs of an embedded Ray (None: the machine's)

    def validate(self) -> RayConfig:
        if not self.address.strip():
            raise ValueError("address: must be 'local' or a cluster address such as 10.0.0.1:6379")
        if self.num_cpus is not None:
            if self.address != "local":
                raise ValueError("num_cpus: only for an embedded Ray (address 'local'); a cluster has its own")
            if self.num_cpus < 1:
                raise ValueError(f"num_cpus: must be ≥ 1, got {self.num_cpus}")
        return self


@dataclass(frozen=True)
class MeshIdConfig:
    # Names this mesh in Ray: its namespace, controller and stored keys derive from it, so several meshes (models)
    # share one Ray cluster. "default" keeps namespace `expertmesh`; "chat" gets `expertmesh-chat` (README: Actor
    # naming). A DNS label: lower-case letters, digits and '-'.
    id: str = DEFAULT_MESH_ID

    def validate(self) -> MeshIdConfig:
        problem = mesh_id_problem(self.id)
        if problem is not None:
            raise ValueError(f"id: {problem}")
        return self


EXPERT_LAYOUTS = ("auto", "per-expert", "per-device")


@dataclass(frozen=True)
class ExpertsConfig:
    replicas_per_expert: int = 1  # replicas of each actor group expert-e{G}-r{R} (README: Expert layout)
    # Which default pool (no placement file, no elasticity): "per-expert" = actor expert-e{E}-r{R} hosts expert E of
    # every MoE layer; "per-device" = one actor per GPU (per node without GPUs) hosting a slice of every layer's
    # experts, one call per actor per layer; "auto" = per-expert only where every such actor gets a core (GPU) of its
    # own and the model has at most 16 experts per layer, else per-device (cluster/default_pool.py).
    layout: str = "auto"
    num_cpus_per_actor: float | None = None  # None: share each node's CPUs among its actors (≤ 1 each)
    # Every actor loaded its weights and answered, or start-up fails. The default lets an actor fetch and read a
    # large shard set (e.g. 1/8 of a 100 GB checkpoint from the Hub, or all of it from a ~100 MB/s cloud disk).
    start_timeout_s: float = 1800.0
    placement: str | None = None  # a PLACEMENT.json (`expertmesh plan`): one actor per GPU hosting its shards
    # Memory check of the pool on GPU nodes (router_service/gpu_fit.py): each GPU's memory (None: probed with
    # nvidia-smi on its node), the fraction of it expert weights + runtime may use, and how long to wait for the
    # autoscaler to add missing GPUs (0, or no autoscaler running: stop at once with one line).
    gpu_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    gpu_wait_s: float = 600.0
    # Routed experts' weights: "none" in model.dtype; "int8" per output channel or "int4" in groups of 128 inputs,
    # quantised as each actor loads them, activations in model.dtype (experts/quant.py; README: Quantised experts).
    quant: str = "none"
    # Memory tiers (README: Offload): each actor's device budget for expert weights in GiB; shards beyond it wait
    # in host memory (GPU) or the memory-mapped checkpoint (CPU) and are loaded on demand. None: all resident.
    memory_gb: float | None = None
    # Loading the next layer's predicted experts while the current one computes: "off", "gate" (the current hidden
    # state through the next layer's gate), "history" (the experts the next layer used last step); "auto": gate
    # when memory_gb is set, else off.
    prefetch: str = "auto"
    # With memory_gb: which resident shard leaves when a load needs room (experts/eviction.py): "layer-cycle" (the
    # shard whose layer runs again last: Belady's order for decode cycling through the layers), "lru", "lfru"
    # (frequency over 30 s, then recency), "arc". Compared on a recorded routing trace (README: Offload).
    eviction: str = "layer-cycle"
    # Which predictions become prefetch hints (router_service/prefetch_policy.py): gate mode hints an expert only
    # when some token gives it at least this probability (0: every top-k pick); at most this many shards per layer
    # (None: no cap); hints stop while the measured precision is below the floor (0: never), probing 1 layer in 8.
    prefetch_min_confidence: float = 0.0
    prefetch_max_shards: int | None = None
    prefetch_min_precision: float = 0.0
    # Keep hints on only while they make decode steps faster (router_service/prefetch_governor.py): the router
    # alternates 8-step windows with hints on and off (3 pairs), keeps the faster, and measures again after this many
    # decode steps (0: at once). None: no governor, hints always follow the policy above.
    prefetch_governor_hold_steps: int | None = 256

    def prefetch_mode(self, transport: str = "refs") -> str:
        """prefetch with "auto" resolved: gate with a memory budget (unless the transport is compiled, whose actors
        take no side calls), else off."""
        if self.prefetch == "auto":
            return "gate" if self.memory_gb is not None and transport != "compiled" else "off"
        return self.prefetch

    def prefetch_policy(self):
        """The hint policy of these settings (router_service/prefetch_policy.py)."""
        from .prefetch_policy import PrefetchPolicy

        return PrefetchPolicy(self.prefetch_min_confidence, self.prefetch_max_shards, self.prefetch_min_precision)

    def prefetch_governor(self):
        """A fresh governor of these settings (router_service/prefetch_governor.py), or None when off."""
        from .prefetch_governor import GovernorSettings, PrefetchGovernor

        if self.prefetch_governor_hold_steps is None:
            return None
        return PrefetchGovernor(GovernorSettings(hold_steps=self.prefetch_governor_hold_steps))

    def validate(self) -> ExpertsConfig:
        if self.replicas_per_expert < 1:
            raise ValueError(f"replicas_per_expert: must be an integer ≥ 1, got {self.replicas_per_expert}")
        if self.layout not in EXPERT_LAYOUTS:
            raise ValueError(f"layout: must be one of {EXPERT_LAYOUTS}, got {self.layout!r}")
        if self.num_cpus_per_actor is not None and not self.num_cpus_per_actor > 0:
            raise ValueError(f"num_cpus_per_actor: must be > 0, got {self.num_cpus_per_actor}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {self.start_timeout_s}")
        if self.gpu_memory_gb is not None and not self.gpu_memory_gb > 0:
            raise ValueError(f"gpu_memory_gb: must be > 0, got {self.gpu_memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.gpu_wait_s >= 0:
            raise ValueError(f"gpu_wait_s: must be ≥ 0, got {self.gpu_wait_s}")
        if self.quant not in QUANT_MODES:
            raise ValueError(f"quant: must be one of {QUANT_MODES}, got {self.quant!r}")
        if self.placement is not None and not Path(self.placement).is_file():
            raise ValueError(f"placement: {self.placement} is not a file")
        if self.memory_gb is not None and not (self.memory_gb > 0 and math.isfinite(self.memory_gb)):
            raise ValueError(f"memory_gb: must be a positive finite number of GiB, got {self.memory_gb}")
        for name in ("prefetch_min_confidence", "prefetch_min_precision"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {value}")
        if self.prefetch_max_shards is not None and self.prefetch_max_shards < 1:
            raise ValueError(f"prefetch_max_shards: must be ≥ 1 or null, got {self.prefetch_max_shards}")
        hold = self.prefetch_governor_hold_steps
        if hold is not None and (isinstance(hold, bool) or not isinstance(hold, int) or hold < 0):
            raise ValueError(f"prefetch_governor_hold_steps: must be an integer ≥ 0 or null, got {hold!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction: must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        if self.prefetch not in PREFETCH_SETTINGS:
            raise ValueError(f"prefetch: must be one of {PREFETCH_SETTINGS}, got {self.prefetch!r}")
        return self


@dataclass(frozen=True)
class RouterConfig:
    # How expert calls travel: "refs" | "grpc" | "socket" | "compiled" | "rdt", or "auto": socket on an embedded
    # Ray, refs on a joined cluster (README: Transports).
    transport: str = "auto"
    # Ping-pong two micro-batches per step, expert rounds under dense work (README: Overlap): True, False, or "auto":
    # the latency model decides per step (cluster/overlap_policy.py; on a CPU it is always off).
    overlap: bool | Literal["auto"] = False
    # Replay decode steps as CUDA graphs, per batch-size bucket (README: CUDA graphs; experts/decode_graphs.py):
    # "auto": on for a router on a GPU whose model's decode step can be graphed, "on": that or refuse to start,
    # "off": eager. Batches above cuda_graph_max_batch decode eagerly.
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    cuda_graph_max_batch: int = 256
    capacity_factor: float | None = None  # None: no cap, no token is ever moved or dropped
    # torch threads of a router; None: the CPUs it was given (a Serve replica: what Ray assigned it, at least 1; an
    # in-process router: torch's default, the process's CPUs). Setting it also makes a Serve replica reserve as many.
    threads: int | None = None
    # GPUs each router replica asks Ray for (fractions share one); > 0 puts its dense weights, KV cache and
    # sampling on cuda:0 of what it gets. 0: the router computes on CPU.
    gpus: float = 0.0
    replicas: int = 1  # Serve replicas of the router deployment
    autoscale: tuple[int, int] | None = None  # (min, max) Serve replicas, scaled on ongoing requests; None: fixed
    batcher: BatcherConfig = field(default_factory=BatcherConfig)  # continuous batching (Serve replicas)
    # The paged KV cache (README: Paged KV cache): its size in GiB; None: 2 GiB on CPU (at most 64 full contexts),
    # on a GPU what keeps the router within gpu_memory_utilization of the GPU's memory after its weights.
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    kv_block_size: int = 16  # tokens per KV-cache block
    # Automatic prefix caching (README: Prefix caching): full KV-cache blocks are shared between requests by content,
    # so a repeated prefix (a long system prompt) is not computed again; false: every request computes its prompt.
    prefix_caching: bool = True

    def validate(self) -> RouterConfig:
        if self.transport not in TRANSPORT_SETTINGS:
            raise ValueError(f"transport: must be one of {TRANSPORT_SETTINGS}, got {self.transport!r}")
        if self.capacity_factor is not None and not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            raise ValueError(f"capacity_factor: must be a positive finite number, got {self.capacity_factor}")
        if isinstance(self.overlap, str) and self.overlap != "auto":
            raise ValueError(f"overlap: must be true, false or \"auto\", got {self.overlap!r}")
        if self.overlap is True and self.capacity_factor is not None:
            raise ValueError("overlap: cannot be combined with capacity_factor (capacity is per step; micro-batches "
                             "would change which tokens overflow)")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs: must be auto, on or off, got {self.cuda_graphs!r}")
        if self.cuda_graphs == "on" and self.gpus == 0:
            raise ValueError("cuda_graphs: on needs a router on a GPU (router.gpus > 0); the router computes on CPU")
        if self.cuda_graphs == "on" and self.capacity_factor is not None:
            raise ValueError("cuda_graphs: on cannot be combined with capacity_factor (which tokens overflow is "
                             "decided on the host)")
        if not isinstance(self.cuda_graph_max_batch, int) or self.cuda_graph_max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch: must be an integer ≥ 1, got {self.cuda_graph_max_batch!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be ≥ 1, got {self.threads}")
        if not (self.gpus >= 0 and math.isfinite(self.gpus)):
            raise ValueError(f"gpus: must be a finite number ≥ 0, got {self.gpus}")
        if self.gpus > 1 and self.gpus != int(self.gpus):
            raise ValueError(f"gpus: above 1 must be a whole number, got {self.gpus}")
        if self.replicas < 1:
            raise ValueError(f"replicas: must be ≥ 1, got {self.replicas}")
        if self.autoscale is not None and not 1 <= self.autoscale[0] <= self.autoscale[1]:
            raise ValueError(f"autoscale: need 1 ≤ min ≤ max, got {self.autoscale[0]}:{self.autoscale[1]}")
        if self.kv_cache_gb is not None and not (self.kv_cache_gb > 0 and math.isfinite(self.kv_cache_gb)):
            raise ValueError(f"kv_cache_gb: must be a positive finite number, got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size: must be ≥ 1, got {self.kv_block_size}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching: must be true or false, got {self.prefix_caching!r}")
        return self

    def deployment_options(self) -> dict:
        """Ray Serve options of the router deployment (replicas or autoscaling)."""
        if self.autoscale is None:
            return {"num_replicas": self.replicas}
        low, high = self.autoscale
        return {"autoscaling_config": {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": 32}}

    def replica_resources(self) -> dict:
        """What each router replica asks Ray for. CPUs: `threads` when set; otherwise 1 with a GPU (it feeds the
        GPU), else none, because by default the expert actors share every CPU of a node between them and a replica
        asking for one could not be placed (it then runs 1 thread on the CPUs the actors leave idle)."""
        cpus = self.threads if self.threads is not None else (1 if self.gpus > 0 else 0)
        return {"num_cpus": cpus, "num_gpus": self.gpus}


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC front of `expertmesh serve` (router_service/grpc_front.py)."""

    host: str = "127.0.0.1"  # localhost only unless told otherwise
    port: int = 9000  # 0 picks a free port (printed on the ready line)
    tls_cert: str | None = None  # PEM files; both or neither
    tls_key: str | None = None
    auth_token: str | None = None  # clients send `authorization: Bearer <token>`; None: no auth
    # Kill/Drain/UndrainReplica need this too, as `x-expertmesh-admin-token` metadata; None: they are refused
    # (router_service/admin_auth.py).
    admin_token: str | None = None
    max_message_bytes: int = 16 * 1024 * 1024  # largest request; responses up to max_response_bytes
    # The OpenAI-compatible HTTP API and the live cluster page (router_service/http_front.py) on this port, same
    # host, token and TLS as gRPC; None: off. 0 picks a free port (printed on the ready line).
    http_port: int | None = None
    # Deepest nesting of arrays and objects an HTTP JSON body may have, checked before it is parsed
    # (router_service/json_body.py): a deep body made the parser recurse until it failed (a 500). A chat body with
    # content parts is 6 deep; tools' JSON schemas go deeper.
    max_json_depth: int = 32

    def validate(self) -> ServerConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_key: give tls_cert and tls_key together, or neither")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: {path} is not a file")
        if self.tls_cert is not None:
            check_tls_pair(self.tls_cert, self.tls_key)  # PEM, a key that belongs to the certificate
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65536), got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port: must be in [0, 65536), got {self.http_port}")
        if self.http_port is not None and self.http_port != 0 and self.http_port == self.port:
            raise ValueError(f"http_port: must differ from port ({self.port})")
        if not 1024 <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes: must be in [1024, {MAX_MESSAGE_BYTES}] (1 GiB), got "
                             f"{self.max_message_bytes}")
        if not 8 <= self.max_json_depth <= MAX_JSON_DEPTH:
            raise ValueError(f"max_json_depth: must be in [8, {MAX_JSON_DEPTH}], got {self.max_json_depth}")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth_token: must not be blank")
        if self.admin_token is not None and not self.admin_token.strip():
            raise ValueError("admin_token: must not be blank")
        if self.admin_token is not None and self.admin_token == self.auth_token:
            raise ValueError("admin_token: must differ from auth_token (every client holding the bearer token "
                             "could otherwise drain replicas)")
        return self

    @property
    def max_response_bytes(self) -> int:
        """Largest response: logits are big (positions × vocabulary × 4 bytes), so at least 64 MiB."""
        return max(self.max_message_bytes, MIN_RESPONSE_BYTES)

    def check_can_listen(self) -> None:
        """The host resolves to this machine and the port is free: for `expertmesh serve`, before Ray starts. Not
        part of validate(), which also runs where the front does not listen (a Serve config, a drill's plan)."""
        try:
            check_can_listen(self.host, self.port)
        except ValueError as exc:
            raise ConfigError(*f"server.{exc}".split(": ", 1)) from None
        if self.http_port:
            try:
                check_can_listen(self.host, self.http_port)
            except ValueError as exc:
                field, message = str(exc).split(": ", 1)
                raise ConfigError("server.http_port" if field == "port" else f"server.{field}", message) from None


@dataclass(frozen=True)
class MeshConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshIdConfig = field(default_factory=MeshIdConfig)  # which mesh on the Ray cluster (README: Actor naming)
    ray: RayConfig = field(default_factory=RayConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)  # README: Data types and devices
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)  # off by default (README: Metrics and traces)
    server: ServerConfig = field(default_factory=ServerConfig)

    def validate(self) -> MeshConfig:
        """Every section, then the settings that depend on each other. Raises ConfigError naming the field."""
        validate_tree(self)
        planned = self.experts.placement is not None or self.controller.elastic is not None
        if planned and self.experts.replicas_per_expert != 1:
            raise ConfigError("experts.replicas_per_expert", "a planned placement (experts.placement or "
                                                             "controller.elastic) sets the replicas; leave it at 1")
        if self.experts.prefetch not in ("auto", "off") and self.router.transport == "compiled":
            raise ConfigError("experts.prefetch", "prefetch hints travel as Ray actor calls, which a compiled graph's "
                                                  "actors do not take; use router.transport refs, grpc or socket")
        return self

    @classmethod
    def from_dict(cls, data: dict | None) -> MeshConfig:
        """From plain data (a YAML file, Serve's args); missing keys keep their defaults, unknown keys are refused."""
        return from_dict(cls, data)

    def to_dict(self) -> dict:
        return to_dict(self)

    @classmethod
    def load(cls, path: str | Path) -> MeshConfig:
        """From a YAML (.yaml/.yml) or JSON file holding the tree."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml  # a dependency of ray[serve]

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as exc:  # yaml.YAMLError, json.JSONDecodeError
            raise ConfigError("config", f"{path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}") from None
        return cls.from_dict(data)

    def replace(self, **settings: Any) -> MeshConfig:
        """A copy with settings given by dotted path, e.g. `config.replace(**{"router.transport": "grpc"})`."""
        config = self
        for dotted, value in settings.items():
            config = replace_path(config, dotted, value)
        return config
