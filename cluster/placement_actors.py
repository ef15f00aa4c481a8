"""From a shard placement to expert actors and a routing table, and from one placement to the next. Pure; no Ray.

One actor per live GPU that hosts anything, named `expert-g{gpu}-v{version}` (cluster/naming.py), hosting every shard
the GPU holds in every layer; so in each layer a GPU gets at most one call. Layer i of a placement is the model's
i-th MoE layer: pass `layer_ids = cfg.moe_layers` to name shards by the model's layer numbers.

A transition from the actors now running to a new placement keeps every actor whose GPU keeps exactly its shard set,
starts a new version for every GPU whose set changed (load + warm it first), and drains then stops the replaced ones
once the routing table of the new epoch is live and their in-flight calls are done:

    t = transition(running, new_placement, layer_ids=cfg.moe_layers)
    start t.start (name -> ActorPlan: gpu, node, shards), wait until warm
    publish routing_table(t.actors, epoch + 1); routers switch between steps
    drain, then stop, t.drain
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .actor_slots import NodeResources
from .naming import gpu_actor_name, parse_gpu_actor_name
from .routing_table import RoutingTable, Shard
from .shard_placement import Placement, Topology


@dataclass(frozen=True)
class ActorPlan:
    name: str
    gpu: int  # global GPU index: node = gpu // gpus_per_node, local GPU = gpu % gpus_per_node
    node: int
    shards: tuple[Shard, ...]  # (model layer id, expert), sorted


@dataclass(frozen=True)
class Transition:
    actors: dict[str, list[Shard]]  # the whole new pool: actor -> shards (feed RoutingTable.from_actor_shards)
    keep: list[str] = field(default_factory=list)  # running actors that stay as they are
    start: dict[str, ActorPlan] = field(default_factory=dict)  # actors to start, load and warm before publishing
    drain: list[str] = field(default_factory=list)  # actors to drain, then stop, after the new table is live
    shards_to_load: int = 0  # shard replicas the started actors load that their GPU did not have (the moves)


def actor_plans(placement: Placement, layer_ids: list[int] | None = None,
                versions: dict[int, int] | None = None) -> dict[str, ActorPlan]:
    """One ActorPlan per GPU hosting shards; versions: gpu -> version for its name (default 0)."""
    layer_ids = _layer_ids(placement, layer_ids)
    versions = versions or {}
    per = placement.topology.gpus_per_node
    plans = {}
    for gpu in range(placement.topology.num_gpus):
        shards = tuple((layer_ids[layer], expert) for layer, expert in placement.gpu_shards(gpu))
        if shards:
            name = gpu_actor_name(gpu, versions.get(gpu, 0))
            plans[name] = ActorPlan(name=name, gpu=gpu, node=gpu // per, shards=shards)
    return plans


def actor_shards(placement: Placement, layer_ids: list[int] | None = None) -> dict[str, list[Shard]]:
    """actor name -> shards, for expertmesh's pool (PoolSpec.actor_shards) at version 0."""
    return {name: list(p.shards) for name, p in actor_plans(placement, layer_ids).items()}


def routing_table(actors: dict[str, list[Shard]], epoch: int) -> RoutingTable:
    """The routing table of a pool (e.g. Transition.actors); replicas listed in actor-name order."""
    return RoutingTable.from_actor_shards({a: actors[a] for a in sorted(actors)}, epoch=epoch)


def transition(running: dict[str, list[Shard]], new: Placement, layer_ids: list[int] | None = None) -> Transition:
    """running: the actors now serving (name -> shards); names of the `expert-g{gpu}-v{version}` form belong to a
    GPU, any other name (e.g. the default pool's `expert-e{e}-r{r}`) is simply replaced and drained.

    Returns what to keep, start (next version per GPU) and drain to reach `new`."""
    wanted = actor_plans(new, layer_ids)
    by_gpu: dict[int, tuple[str, int]] = {}  # gpu -> (running actor, version), the newest per GPU
    for name in running:
        parsed = parse_gpu_actor_name(name)
        if parsed and (parsed[0] not in by_gpu or parsed[1] > by_gpu[parsed[0]][1]):
            by_gpu[parsed[0]] = (name, parsed[1])
    had: dict[int, set[Shard]] = {gpu: set(running[name]) for gpu, (name, _) in by_gpu.items()}
    actors: dict[str, list[Shard]] = {}
    keep, start, loads = [], {}, 0
    for plan in wanted.values():
        old = by_gpu.get(plan.gpu)
        if old is not None and set(running[old[0]]) == set(plan.shards):
            keep.append(old[0])
            actors[old[0]] = list(plan.shards)
            continue
        version = old[1] + 1 if old is not None else 0
        name = gpu_actor_name(plan.gpu, version)
        while name in running:  # an older, stale version with that number still around
            version += 1
            name = gpu_actor_name(plan.gpu, version)
        start[name] = ActorPlan(name=name, gpu=plan.gpu, node=plan.node, shards=plan.shards)
        actors[name] = list(plan.shards)
        loads += len(set(plan.shards) - had.get(plan.gpu, set()))
    drain = sorted(set(running) - set(keep))
    return Transition(actors=actors, keep=sorted(keep), start=start, drain=drain, shards_to_load=loads)


def topology_for_nodes(nodes: list[NodeResources], slots_per_gpu: int) -> tuple[Topology, list[str]]:
    """The planner's view of a Ray cluster: GPU nodes sorted by id, each with the most GPUs any has; the GPUs a
    smaller node lacks count as failed, so nothing lands on them. Returns (topology, node_ids by node index)."""
    gpu_nodes = sorted((n for n in nodes if n.num_gpus > 0), key=lambda n: n.node_id)
    if not gpu_nodes:
        raise ValueError("nodes: no node has a GPU; planned placements need GPUs")
    per = max(n.num_gpus for n in gpu_nodes)
    missing = frozenset(i * per + g for i, n in enumerate(gpu_nodes) for g in range(n.num_gpus, per))
    return Topology(len(gpu_nodes), per, slots_per_gpu, missing), [n.node_id for n in gpu_nodes]


def _layer_ids(placement: Placement, layer_ids: list[int] | None) -> list[int]:
    if layer_ids is None:
        return list(range(placement.layers))
    layer_ids = [int(i) for i in layer_ids]
    if len(layer_ids) != placement.layers:
        raise ValueError(f"layer_ids: {len(layer_ids)} ids for a placement of {placement.layers} layers")
    return layer_ids
