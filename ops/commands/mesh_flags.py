"""Command-line flags of the configuration tree: each flag sets exactly one MeshConfig field (router_service/config.py).

Flags default to "not given" (argparse.SUPPRESS), so the value comes from, in order: the flag, `--config FILE` (YAML
or JSON holding the tree), the dataclass default. `mesh_config_from_args` applies them and validates once; an error
names the field by its dotted path. Commands pick the groups of flags that make sense for them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from ...cluster.controller_placement import CONTROLLER_PLACEMENTS
from ...experts.devices import GPU_WITHOUT_CUDA
from ...experts.errors import ConfigError
from ...experts.setting_choices import EVICTION_POLICIES, PREFETCH_SETTINGS
from ...router_service.batching_config import ADMISSION_POLICIES
from ...router_service.config import DTYPES, EXPERT_LAYOUTS, MeshConfig
from ...router_service.config_tree import replace_path
from ...router_service.transports.base import TRANSPORT_SETTINGS


def _autoscale_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be MIN:MAX, got {text!r}") from exc
    return low, high


def _overlap_value(text: str) -> bool | str:
    values = {"auto": "auto", "on": True, "off": False, "true": True, "false": False}
    if text.lower() not in values:
        raise argparse.ArgumentTypeError(f"must be auto, on or off, got {text!r}")
    return values[text.lower()]


@dataclass(frozen=True)
class Flag:
    flag: str
    path: str  # the dotted MeshConfig field it sets
    group: str
    help: str
    kwargs: dict[str, Any] = field(default_factory=dict)  # argparse: type, choices, action, const, metavar


FLAGS: tuple[Flag, ...] = (
    Flag("--model", "model.path", "model", "checkpoint folder or Hugging Face repo id org/name (default: the embedded "
         "model)", {"metavar": "DIR|REPO"}),
    Flag("--revision", "model.revision", "model", "with a repo id: branch, tag or commit"),
    Flag("--model-name", "model.name", "model", "name clients use (default: folder name; expertmesh-demo if "
         "embedded)"),
    Flag("--dtype", "model.dtype", "model", "weights and activations; auto: the checkpoint's dtype on a GPU, "
         "float32 on a CPU (README: Data types)", {"choices": DTYPES}),
    Flag("--address", "ray.address", "ray", "Ray cluster to join (default: start an embedded one)"),
    Flag("--mesh-id", "mesh.id", "ray", "which mesh on the Ray cluster: its namespace, controller and stored keys "
         "derive from it, so several models share one Ray (a DNS label)"),
    Flag("--ray-cpus", "ray.num_cpus", "ray", "CPUs of the embedded Ray (default: the machine's)", {"type": int}),
    Flag("--replicas-per-expert", "experts.replicas_per_expert", "experts", "replicas of each expert actor",
         {"type": int}),
    Flag("--expert-layout", "experts.layout", "experts", "default pool: per-expert (one actor per expert), "
         "per-device (one per GPU, or node without GPUs, hosting a slice of every layer), auto: per-expert only "
         "where each actor gets its own core/GPU (README: Expert layout)", {"choices": EXPERT_LAYOUTS}),
    Flag("--cpus-per-actor", "experts.num_cpus_per_actor", "experts", "CPUs per expert actor (default: a share "
         "of each node's)", {"type": float}),
    Flag("--actor-start-timeout", "experts.start_timeout_s", "experts", "seconds for every expert actor to load "
         "(default 1800)", {"type": float}),
    Flag("--gpu-memory-gb", "experts.gpu_memory_gb", "experts", "memory of each GPU in GiB (default: nvidia-smi on "
         "each GPU node); the expert pool is checked against it by bytes before any actor loads", {"type": float}),
    Flag("--expert-gpu-memory-utilization", "experts.gpu_memory_utilization", "experts", "fraction of each expert "
         "GPU the pool may fill (default 0.9)", {"type": float}),
    Flag("--gpu-wait", "experts.gpu_wait_s", "experts", "seconds to wait for the autoscaler to add GPUs the pool is "
         "missing (default 600; 0: stop at once)", {"type": float}),
    Flag("--expert-memory-gb", "experts.memory_gb", "experts", "device budget per expert actor for expert weights, "
         "in GiB; shards beyond it wait in host memory / the mapped checkpoint and load on demand (README: Offload; "
         "default: all resident)", {"type": float}),
    Flag("--prefetch", "experts.prefetch", "experts", "load the next layer's predicted experts while the current "
         "one computes: gate | history | off (default auto: gate with --expert-memory-gb)",
         {"choices": PREFETCH_SETTINGS}),
    Flag("--eviction", "experts.eviction", "experts", "with --expert-memory-gb, which resident shard leaves when a "
         "load needs room: layer-cycle (best on a recorded decode trace) | lru | lfru | arc",
         {"choices": EVICTION_POLICIES}),
    Flag("--expert-quant", "experts.quant", "experts", "store routed experts' weights as int8 (per output channel) "
         "or int4 (groups of 128 inputs), quantised at load; activations stay in --dtype (README: Quantised "
         "experts)", {"choices": ("none", "int8", "int4")}),
    Flag("--restore-timeout", "controller.restore_timeout_s", "controller", "seconds a restored actor may take to "
         "load (default 1800)", {"type": float}),
    Flag("--placement", "experts.placement", "experts", "start from a PLACEMENT.json (`expertmesh plan`): one "
         "expert actor per GPU hosting that GPU's shards", {"metavar": "FILE"}),
    Flag("--transport", "router.transport", "router", "how routers reach expert actors (README: Transports)",
         {"choices": TRANSPORT_SETTINGS}),
    Flag("--overlap", "router.overlap", "router", "split each step into two micro-batches whose expert rounds "
         "overlap the other's dense compute (README: Transports / Overlap); `--overlap auto`: the latency model "
         "decides per step (off on a CPU), `--overlap off`: never",
         {"nargs": "?", "const": True, "type": _overlap_value, "metavar": "auto|on|off"}),
    Flag("--cuda-graphs", "router.cuda_graphs", "router", "replay decode steps as CUDA graphs per batch-size bucket "
         "(README: CUDA graphs): auto (default) = on for a router on a GPU whose model allows it, on = that or refuse "
         "to start, off = eager", {"choices": ("auto", "on", "off")}),
    Flag("--cuda-graph-max-batch", "router.cuda_graph_max_batch", "router", "decode batches above this many "
         "sequences run eagerly (default 256)", {"type": int}),
    Flag("--capacity-factor", "router.capacity_factor", "router", "cap tokens per expert per step (default: no "
         "cap, no token is ever dropped)", {"type": float}),
    Flag("--router-threads", "router.threads", "router", "torch threads per router; a Serve replica also reserves "
         "that many CPUs (default: the CPUs it was given, at least 1)", {"type": int}),
    Flag("--router-gpus", "router.gpus", "router", "GPUs per router (fractions share one): its dense weights, KV "
         "cache and sampling run on cuda:0 (default: 0, on CPU)", {"type": float}),
    Flag("--kv-cache-gb", "router.kv_cache_gb", "router", "size of the paged KV cache in GiB, preallocated on the "
         "router's device (default: 2 on CPU, at most 64 full contexts; on a GPU see --gpu-memory-utilization)",
         {"type": float}),
    Flag("--gpu-memory-utilization", "router.gpu_memory_utilization", "router", "on a GPU without --kv-cache-gb: "
         "the KV cache takes what keeps the router within this fraction of the GPU's memory after its weights",
         {"type": float}),
    Flag("--kv-block-size", "router.kv_block_size", "router", "tokens per KV-cache block", {"type": int}),
    Flag("--no-prefix-caching", "router.prefix_caching", "router", "compute every prompt in full instead of "
         "reusing the KV-cache blocks of a prefix an earlier request computed (README: Prefix caching; default on)",
         {"action": "store_const", "const": False}),
    Flag("--gpu-without-cuda", "devices.gpu_without_cuda", "devices", "an expert actor or router replica that "
         "Ray gave a GPU while torch sees no CUDA: refuse to start with one line, or compute on the CPU anyway "
         "(README: Data types and devices)", {"choices": GPU_WITHOUT_CUDA}),
    Flag("--router-replicas", "router.replicas", "serve", "Serve replicas of the router", {"type": int}),
    Flag("--router-autoscale", "router.autoscale", "serve", "autoscale router replicas",
         {"type": _autoscale_range, "metavar": "MIN:MAX"}),
    Flag("--max-active", "router.batcher.max_active", "serve", "sequences decoding together per router",
         {"type": int}),
    Flag("--max-waiting", "router.batcher.max_waiting", "serve", "queued requests per router before "
         "RESOURCE_EXHAUSTED", {"type": int}),
    Flag("--max-prefill-tokens", "router.batcher.max_prefill_tokens", "serve", "prompt tokens computed in one "
         "step: a longer prompt is prefilled in chunks while running streams keep decoding", {"type": int}),
    Flag("--admission", "router.batcher.admission", "serve", "which waiting requests take free decode slots: "
         "oldest first, or those whose predicted experts overlap most with the running batch (fewer shards per "
         "step; README: Offload)", {"choices": ADMISSION_POLICIES}),
    Flag("--affinity-max-wait", "router.batcher.affinity_max_wait_s", "serve", "affinity admission's fairness "
         "bound: a request waiting this many seconds is admitted first, oldest first", {"type": float}),
    Flag("--no-replica-policy", "failover.no_replica_policy", "failover", "when every replica of an expert is "
         "down: hold its tokens until one is back (up to --wait-timeout, then UNAVAILABLE), or send them to the "
         "next-best expert and count them", {"choices": ("wait", "degrade")}),
    Flag("--wait-timeout", "failover.wait_timeout_s", "failover", "seconds a step holds tokens of an expert with "
         "no live replica", {"type": float}),
    Flag("--call-timeout", "failover.call_timeout_s", "failover", "an expert call slower than this is retried on "
         "another replica", {"type": float}),
    Flag("--node-poll", "failover.node_poll_s", "failover", "seconds between a router's reads of Ray's node table: "
         "replicas on a node Ray calls dead are dropped at once and calls in flight to them retried elsewhere "
         "(default 0.5; 0: off, wait for the calls to fail)", {"type": float}),
    Flag("--shed-overload", "failover.shed.enabled", "failover", "overload shedding: a shard above --shed-threshold "
         "of its replicas' capacity for --shed-window-s sends up to --shed-max-share of its tokens to their next-best "
         "expert, counted (README: Overload shedding; default off)", {"action": "store_const", "const": True}),
    Flag("--shed-capacity", "failover.shed.replica_tokens_per_step", "failover", "with --shed-overload: token slots "
         "one expert replica serves per expert round (its capacity)", {"type": int}),
    Flag("--shed-threshold", "failover.shed.threshold", "failover", "with --shed-overload: utilisation that starts "
         "the window", {"type": float}),
    Flag("--shed-window-s", "failover.shed.window_s", "failover", "with --shed-overload: seconds above the threshold "
         "before shedding", {"type": float}),
    Flag("--shed-off-threshold", "failover.shed.off_threshold", "failover", "with --shed-overload: utilisation "
         "below which shedding stops after --shed-off-window-s", {"type": float}),
    Flag("--shed-off-window-s", "failover.shed.off_window_s", "failover", "with --shed-overload: seconds below the "
         "off threshold before shedding stops", {"type": float}),
    Flag("--shed-max-share", "failover.shed.max_share", "failover", "with --shed-overload: most of a shard's tokens "
         "moved per expert round", {"type": float}),
    Flag("--no-controller", "controller.enabled", "controller", "run no controller (no restores, no Admin "
         "kill/drain, no elasticity)", {"action": "store_const", "const": False}),
    Flag("--no-restore", "controller.restore", "controller", "do not restore lost expert actors",
         {"action": "store_const", "const": False}),
    Flag("--controller-placement", "controller.placement", "controller", "where the controller actor runs: the "
         "head node (default), a node hosting no expert actor, or any node (README: Failover)",
         {"choices": CONTROLLER_PLACEMENTS}),
    Flag("--controller-cpus", "controller.num_cpus", "controller", "CPUs the controller actor reserves (default 0)",
         {"type": float}),
    Flag("--controller-node-poll", "controller.node_poll_s", "controller", "seconds between the controller's reads "
         "of Ray's node table: actors on a dead node are restored at once (default 0.5; 0: off, probes only)",
         {"type": float}),
    Flag("--stand-in-min-cpus", "controller.stand_in_min_cpus", "controller", "a lost expert actor the survivors "
         "have no room for gets a stand-in with a smaller CPU share, at least this much; below it lost actors merge "
         "into fewer stand-ins", {"type": float}),
    Flag("--elastic", "controller.elastic", "controller", "rebalance replicas live from observed load "
         "(README: Elasticity)", {"action": "store_const", "const": {}}),
    Flag("--slots-per-gpu", "controller.elastic.slots_per_gpu", "controller", "with --elastic: shards per GPU "
         "per MoE layer", {"type": int}),
    Flag("--control-interval", "controller.elastic.control_interval_s", "controller", "with --elastic: seconds "
         "between control steps", {"type": float}),
    Flag("--extra-replicas", "controller.elastic.extra_replica_fraction", "controller", "with --elastic: "
         "replicas per layer beyond one per expert, as a fraction", {"type": float}),
    Flag("--autoscale-target", "controller.elastic.autoscale.target_load_per_replica", "controller", "with "
         "--elastic: autoscale replicas so each carries about LOAD routed tokens per load window",
         {"type": float, "metavar": "LOAD"}),
    Flag("--max-gpus", "controller.elastic.autoscale.max_gpus", "controller", "with --autoscale-target: GPU "
         "budget (asks Ray's autoscaler for GPUs beyond what the cluster has)", {"type": int}),
    Flag("--trace", "tracing.exporter", "tracing", "OpenTelemetry traces of requests, steps, layer dispatches and "
         "expert calls (default off); file: JSON lines at --trace-file",
         {"choices": ("none", "console", "otlp", "file")}),
    Flag("--trace-file", "tracing.path", "tracing", "where --trace file appends spans (one JSON per line)",
         {"metavar": "PATH"}),
    Flag("--otlp-endpoint", "tracing.endpoint", "tracing", "OTLP gRPC collector for --trace otlp (default: the "
         "exporter's, http://localhost:4317)", {"metavar": "URL"}),
    Flag("--host", "server.host", "server", "interface to listen on (default: localhost only)"),
    Flag("--port", "server.port", "server", "0 picks a free port (printed on the ready line)", {"type": int}),
    Flag("--tls-cert", "server.tls_cert", "server", "PEM certificate (with --tls-key)", {"metavar": "PEM"}),
    Flag("--tls-key", "server.tls_key", "server", "PEM private key (with --tls-cert)", {"metavar": "PEM"}),
    Flag("--auth-token", "server.auth_token", "server", "require `authorization: Bearer TOKEN` (default: "
         "$EXPERTMESH_TOKEN, else no auth)"),
    Flag("--admin-token", "server.admin_token", "server", "enable Admin Kill/Drain/UndrainReplica for callers "
         "sending `x-expertmesh-admin-token: TOKEN` (default: $EXPERTMESH_ADMIN_TOKEN, else they are refused)"),
    Flag("--max-message-bytes", "server.max_message_bytes", "server", "largest request or response",
         {"type": int}),
    Flag("--http-port", "server.http_port", "server", "also serve the OpenAI-compatible HTTP API and the live "
         "cluster page here (same host, token and TLS; 0 picks a free port; default off)", {"type": int}),
)
GROUPS = tuple(dict.fromkeys(f.group for f in FLAGS))
# What runs in a process of its own without Serve (generate/score --local, bench dispatch).
IN_PROCESS_GROUPS = ("model", "ray", "experts", "router", "devices", "failover", "controller", "tracing")
# A drill's own server: everything but where Ray and the front are (the drill decides those).
DRILLED_SERVER_GROUPS = ("model", "experts", "router", "devices", "serve", "failover", "controller", "tracing")
_AUTOSCALE = "controller.elastic.autoscale."  # autoscale is a dict section (AutoscaleConfig's fields)


def _default(path: str) -> Any:
    node: Any = MeshConfig()
    for name in path.split("."):
        if node is None or isinstance(node, dict):
            return None
        node = getattr(node, name)
    return node


def add_mesh_flags(parser: argparse.ArgumentParser, groups: tuple[str, ...] = GROUPS,
                   config_file: bool = True, extra: tuple[str, ...] = ()) -> None:
    """The flags of `groups`, and `--config FILE`, on `parser`; extra: dotted paths of single flags from other
    groups (e.g. bench dispatch takes --dtype but not --model)."""
    if config_file:
        parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                            help="a YAML or JSON file holding the configuration tree (README: Configuration); "
                                 "flags override it")
    for flag in FLAGS:
        if flag.group not in groups and flag.path not in extra:
            continue
        default = _default(flag.path)
        shown = f" (default: {default})" if default not in (None, {}, False, True) else ""
        parser.add_argument(flag.flag, dest=flag.path, default=argparse.SUPPRESS, help=flag.help + shown,
                            **flag.kwargs)


def mesh_config_from_args(args: argparse.Namespace, defaults: MeshConfig | None = None) -> MeshConfig:
    """--config's file (else `defaults`, else MeshConfig()) with every given flag applied, validated."""
    given = vars(args)
    config = MeshConfig.load(given["config"]) if "config" in given else defaults or MeshConfig()
    flags = [f for f in FLAGS if f.path in given]
    # Sections first (--elastic creates the elastic section, keeping a config file's if it has one), then fields.
    for flag in sorted(flags, key=lambda f: f.path.count(".")):
        value = given[flag.path]
        if flag.path == "controller.elastic":
            if config.controller.elastic is None:
                config = replace_path(config, flag.path, value)
            continue
        if flag.path.startswith("controller.elastic.") and config.controller.elastic is None:
            raise ConfigError(flag.path, f"{flag.flag} needs --elastic")
        if flag.path.startswith(_AUTOSCALE):
            autoscale = dict(config.controller.elastic.autoscale or {})
            key = flag.path.removeprefix(_AUTOSCALE)
            if key != "target_load_per_replica" and "target_load_per_replica" not in autoscale:
                # (--autoscale-target, when given, was applied first: FLAGS order among fields of one depth)
                raise ConfigError(flag.path, f"{flag.flag} needs --autoscale-target")
            autoscale[key] = value
            config = replace_path(config, "controller.elastic.autoscale", autoscale)
            continue
        config = replace_path(config, flag.path, value)
    if "server.auth_token" not in given and config.server.auth_token is None and os.environ.get("EXPERTMESH_TOKEN"):
        config = replace_path(config, "server.auth_token", os.environ["EXPERTMESH_TOKEN"])
    if "server.admin_token" not in given and config.server.admin_token is None \
            and os.environ.get("EXPERTMESH_ADMIN_TOKEN"):
        config = replace_path(config, "server.admin_token", os.environ["EXPERTMESH_ADMIN_TOKEN"])
    return config.validate()
