"""Which expert actors to start, and where: the default layout (one actor per logical expert) or a planned one.

A planned layout (a PLACEMENT.json from `expertmesh plan`, or, with elasticity on, a round-robin start) runs one
actor per GPU hosting that GPU's shards (`expert-g{gpu}-v{version}`, cluster/placement_actors.py). The controller
then replaces actors GPU by GPU as load moves; each takes `gpu_fraction` of its GPU so the next version can load
beside it before it drains.
"""

from __future__ import annotations

from pathlib import Path

from ..cluster.actor_slots import ActorSlot, NodeResources
from ..cluster.elastic import ElasticConfig, actor_slots, cluster_devices
from ..cluster.placement_actors import actor_plans
from ..cluster.routing_table import Shard
from ..cluster.shard_placement import Placement
from ..experts.config import MoEModelConfig
from .errors import RequestError
from .expert_pool import (
    MANY_EXPERTS,
    cluster_device_count,
    cluster_nodes,
    default_actor_groups,
    device_actor_groups,
    device_actor_slots,
)


def load_placement(path: str | Path) -> Placement:
    try:
        return Placement.loads(Path(path).read_text())
    except OSError as exc:
        raise RequestError("placement", f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise RequestError("placement", f"{path}: {exc}") from None


def planned_layout(cfg: MoEModelConfig, nodes: list[NodeResources], elastic: ElasticConfig,
                   placement: Placement | None = None) -> tuple[dict[str, list[Shard]], list[ActorSlot]]:
    """actor name -> shards and their slots for a planned pool. placement None: round-robin over the cluster's
    devices with elastic.slots_per_gpu slots each. A given placement must match the cluster's devices (nodes x GPUs
    per node) and the model (MoE layers x experts)."""
    devices = cluster_devices(nodes, elastic.slots_per_gpu if placement is None
                              else placement.topology.slots_per_gpu)
    layers = len(cfg.moe_layers)
    if placement is None:
        try:
            placement = Placement.round_robin(devices.topology, layers, cfg.num_experts)
        except AssertionError:
            live = devices.topology.num_live
            raise RequestError("slots_per_gpu", f"{elastic.slots_per_gpu} slots on {live} device(s) cannot hold "
                               f"{cfg.num_experts} experts per layer; give at least "
                               f"{-(-cfg.num_experts // live)} (more leaves room for hot replicas)") from None
    else:
        t, have = placement.topology, devices.topology
        if (t.nodes, t.gpus_per_node) != (have.nodes, have.gpus_per_node):
            raise RequestError("placement", f"planned for {t.nodes} nodes x {t.gpus_per_node} GPUs, the cluster has "
                                            f"{have.nodes} x {have.gpus_per_node} for experts (GPUs kept for router "
                                            f"replicas not counted)")
        if (placement.layers, placement.experts) != (layers, cfg.num_experts):
            raise RequestError("placement", f"planned for {placement.layers} MoE layers x {placement.experts} "
                                            f"experts, the model has {layers} x {cfg.num_experts}")
    plans = actor_plans(placement, layer_ids=list(cfg.moe_layers))
    slots = actor_slots(plans, devices, elastic)
    return {name: list(p.shards) for name, p in plans.items()}, list(slots.values())


def default_layout(cfg: MoEModelConfig, replicas_per_expert: int, nodes: list[NodeResources],
                   layout: str = "auto") -> str:
    """"per-expert" or "per-device" for the default pool. auto: one process per expert only when the model has at
    most MANY_EXPERTS experts per layer and each of those actors gets a GPU (GPU cluster) or a core (CPU cluster,
    one core left to the router) of its own. Otherwise per-expert actors share cores: on a 2-core machine 8
    actors + the router made every decode layer a round of up to 8 Ray calls, each actor woken on a busy core
    (measured: 30 ms a step at one stream against 17 ms with one actor per node;
    docs/benchmarks/results/bench/serve_overhead)."""
    if layout != "auto":
        return layout
    actors = cfg.num_experts * replicas_per_expert
    gpus = sum(n.num_gpus for n in nodes)
    room = gpus if gpus else sum(n.num_cpus for n in nodes) - 1
    return "per-expert" if cfg.num_experts <= MANY_EXPERTS and room >= actors else "per-device"


def pool_layout(cfg: MoEModelConfig, replicas_per_expert: int, num_cpus_per_actor: float | None,
                placement_path: str | None, elastic: ElasticConfig | None, layout: str = "auto",
                nodes: list[NodeResources] | None = None) -> tuple[dict[str, list[Shard]], list[ActorSlot] | None]:
    """The pool to start: a planned one (one actor per GPU) when a placement file or elasticity is given, else the
    default grouping (`layout`, see default_layout): one actor per logical expert (slots None: spread over the
    nodes by the caller), or one actor per GPU (per node without GPUs) hosting a slice of every layer's experts
    (expert_pool.device_actor_groups). nodes: what the pool may use (start-up passes the cluster less the GPUs and
    CPUs kept for router replicas, cluster/router_gpus.py); None: the whole cluster."""
    nodes = cluster_nodes() if nodes is None else nodes
    if placement_path is None and elastic is None:
        if default_layout(cfg, replicas_per_expert, nodes, layout) == "per-expert":
            return default_actor_groups(cfg, replicas_per_expert), None
        groups = device_actor_groups(cfg, replicas_per_expert, cluster_device_count(nodes))
        return groups, device_actor_slots(list(groups), nodes, num_cpus_per_actor)
    placement = load_placement(placement_path) if placement_path else None
    return planned_layout(cfg, nodes, elastic or ElasticConfig(num_cpus_per_actor=num_cpus_per_actor), placement)
