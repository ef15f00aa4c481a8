"""The elastic control step: from observed load to the next placement. Pure (numpy); no Ray.

Once per control interval the controller calls `control_step` with the merged load window of every router, the
actors now serving and the cluster's GPUs. It
  1. runs the per-shard autoscaling policy (cluster/autoscale.py) when one is configured, which decides how many
     replicas the pool should have (with hysteresis and a cooldown) and whether to ask Ray's autoscaler for GPUs;
  2. asks the planner (cluster/planner.py) for a placement with that many replicas, starting from the current one so
     few shards move, whenever the replica count changes or a layer's GPU imbalance under the current placement is
     above `rebalance_threshold`;
  3. returns the transition (cluster/placement_actors.py: actors to start, keep, drain) for the controller to apply
     live (start + warm, publish the table, drain), plus the imbalance before and (predicted) after.

Devices: on a cluster with GPUs a "GPU" is a GPU; on a CPU-only cluster every node counts as one device, so the same
logic balances actors across CPU nodes.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from .actor_slots import ActorSlot, NodeResources
from .autoscale import AutoscaleContext, AutoscaleState, decide, initial_state
from .elastic_config import AutoscaleConfig, ElasticConfig  # noqa: F401  (re-exported; numpy-free there for the configuration)
from .placement_actors import ActorPlan, Transition, topology_for_nodes, transition
from .planner import plan
from .routing_table import Shard
from .shard_placement import Placement, Topology


@dataclass(frozen=True)
class Devices:
    """The cluster's devices in planner order: device i lives on node_ids[i // gpus_per_node]."""

    topology: Topology
    node_ids: list[str]
    has_gpus: bool
    cpus_per_node: dict[str, float] = field(default_factory=dict)


def cluster_devices(nodes: list[NodeResources], slots_per_gpu: int) -> Devices:
    """GPU nodes (sorted by id; GPUs per node = the most any has, missing ones marked failed) or, with no GPU
    anywhere, every node as one device."""
    if any(n.num_gpus > 0 for n in nodes):
        topology, node_ids = topology_for_nodes(nodes, slots_per_gpu)
        cpus = {n.node_id: n.num_cpus for n in nodes}
        return Devices(topology, node_ids, True, {node: cpus[node] for node in node_ids})
    cpu_nodes = sorted(nodes, key=lambda n: n.node_id)
    assert cpu_nodes, "no nodes"
    return Devices(Topology(len(cpu_nodes), 1, slots_per_gpu), [n.node_id for n in cpu_nodes], False,
                   {n.node_id: n.num_cpus for n in cpu_nodes})


def actor_slots(plans: dict[str, ActorPlan], devices: Devices, config: ElasticConfig,
                actors_per_node: dict[str, int] | None = None) -> dict[str, ActorSlot]:
    """Where each planned actor goes: its device's node, a GPU fraction (0 on CPU devices) and CPUs (given, or a
    share of the node's CPUs over the actors it will hold during a transition, at most 1)."""
    per_node = dict(actors_per_node or {})
    for p in plans.values():
        node = devices.node_ids[p.node]
        per_node[node] = per_node.get(node, 0) + 1
    slots = {}
    for name, p in plans.items():
        node = devices.node_ids[p.node]
        if config.num_cpus_per_actor is not None:
            cpus = config.num_cpus_per_actor
        else:
            cpus = math.floor(min(1.0, devices.cpus_per_node.get(node, 1.0) / max(per_node[node], 1)) * 100) / 100
            cpus = max(cpus, 0.01)
        slots[name] = ActorSlot(name=name, node_id=node, num_cpus=cpus,
                                num_gpus=config.gpu_fraction if devices.has_gpus else 0.0,
                                gpu_slot=p.gpu % devices.topology.gpus_per_node if devices.has_gpus else None)
    return slots


def locate_actors(running: Mapping[str, object], slots: Mapping[str, ActorSlot], nodes: Mapping[str, str],
                  restoring: Collection[str], devices: Devices) -> dict[str, int] | str:
    """actor -> the index of the device it runs on (its node's first device, plus its slot's GPU on GPU nodes), or a
    reason to skip this control step: an actor not (yet) on a live device, or being restored (failover first).
    nodes: actor -> node it was last seen on (else its slot's)."""
    actor_device = {}
    for name in running:
        slot = slots.get(name)
        node = nodes.get(name) or (slot.node_id if slot else None)
        if node not in devices.node_ids or name in restoring:
            return f"{name} is not placed on a live device yet (failover first)"
        local = slot.gpu_slot if (slot is not None and devices.has_gpus and slot.gpu_slot is not None) else 0
        actor_device[name] = devices.node_ids.index(node) * devices.topology.gpus_per_node + local
    return actor_device


def actors_per_node(actor_device: Mapping[str, int], devices: Devices) -> dict[str, int]:
    """node -> how many of the running actors it holds (new actors' CPU shares count them during a transition)."""
    per_node: dict[str, int] = {}
    for device in actor_device.values():
        node = devices.node_ids[device // devices.topology.gpus_per_node]
        per_node[node] = per_node.get(node, 0) + 1
    return per_node


def current_placement(running: dict[str, list[Shard]], actor_device: dict[str, int], devices: Devices,
                      layer_ids: list[int], experts: int) -> Placement:
    """The placement the running actors form (actors on one device merged). running: actor -> shards with model
    layer ids; actor_device: actor -> device index. ValueError when a device holds more than slots_per_gpu
    shards of a layer (the pool was not started for this many slots)."""
    t = devices.topology
    index = {layer: i for i, layer in enumerate(layer_ids)}
    slots = np.full((len(layer_ids), t.num_gpus, t.slots_per_gpu), -1, dtype=np.int64)
    fill = np.zeros((len(layer_ids), t.num_gpus), dtype=np.int64)
    for actor, shards in running.items():
        g = actor_device[actor]
        for layer, expert in shards:
            li = index[layer]
            if expert in slots[li, g]:
                continue
            if fill[li, g] >= t.slots_per_gpu:
                raise ValueError(f"slots_per_gpu: device {g} holds more than {t.slots_per_gpu} shards of layer "
                                 f"{layer}; start the pool with more slots per GPU")
            slots[li, g, fill[li, g]] = expert
            fill[li, g] += 1
    return Placement(t, experts, slots)


@dataclass(frozen=True)
class ControlOutcome:
    reason: str  # why it acts, or why not ("balanced", "little load", ...)
    imbalance_before: list[float]  # [layers] max/mean GPU load under the current placement
    imbalance_after: list[float] | None = None  # [layers] predicted under the new placement
    transition: Transition | None = None  # None: nothing to do
    placement: Placement | None = None
    request_gpus: int | None = None  # GPU bundles to request from Ray's autoscaler (None: leave as is)
    replicas_before: int = 0
    replicas_after: int = 0


@dataclass(frozen=True)
class ElasticState:
    autoscale: AutoscaleState = field(default_factory=initial_state)
    cluster_gpus: int | None = None  # live devices at the first control step (the autoscaler's base)


def control_step(now: float, load: np.ndarray, current: Placement, running: dict[str, list[Shard]],
                 layer_ids: list[int], state: ElasticState, config: ElasticConfig
                 ) -> tuple[ControlOutcome, ElasticState]:
    """load: [layers, experts] routed slots per shard over the window (rows in `layer_ids` order)."""
    load = np.asarray(load, dtype=np.float64)
    assert load.shape == (current.layers, current.experts), "load: expected [layers, experts] of the placement"
    before = [float(v) for v in current.imbalance(load)]
    replicas_now = current.replica_counts()
    base = dict(imbalance_before=before, replicas_before=int(replicas_now.sum()))
    little = load.sum(axis=1).min() < config.min_window_tokens
    if little and config.autoscale is None:
        return ControlOutcome("little load", **base), state

    topology = current.topology
    request = None
    if state.cluster_gpus is None:
        state = replace(state, cluster_gpus=topology.num_live)
    if config.autoscale is not None:  # it runs on little load too: cold shards scale in, requests are released
        auto = config.autoscale_config(state.cluster_gpus)
        ctx = AutoscaleContext(now=now, load=load, replicas=replicas_now, gpus=topology.num_live)
        decision, auto_state = decide(ctx, state.autoscale, auto)
        state = replace(state, autoscale=auto_state)
        request = decision.request_gpus
        target_replicas = decision.replicas
        scaled = decision.changed
    else:
        extra = int(config.extra_replica_fraction * current.experts)
        target_replicas = None
        scaled = False
    if not scaled and little:
        return ControlOutcome("little load", request_gpus=request, **base), state
    if not scaled and max(before) <= config.rebalance_threshold:
        return ControlOutcome("balanced", request_gpus=request, **base), state

    if target_replicas is not None:
        # The policy sets how many replicas each shard gets; the planner decides where, moving few shards.
        new = plan(load, topology, current, replicas=np.asarray(target_replicas))
    else:
        free = topology.num_live * topology.slots_per_gpu - current.experts
        new = plan(load, topology, current, extra_replicas=min(extra, free))
    if new == current:
        return ControlOutcome("no better placement", request_gpus=request, **base), state
    step = transition(running, new, layer_ids)
    after = [float(v) for v in new.imbalance(load)]
    if not scaled and max(after) >= max(before) - 1e-9:
        return ControlOutcome("no better placement", request_gpus=request, **base), state
    return ControlOutcome("autoscale" if scaled else "rebalance", imbalance_after=after, transition=step,
                          placement=new, request_gpus=request, replicas_after=new.total_replicas(),
                          **base), state
