"""One elastic control pass on the controller's state: from the merged router load and the live nodes to what the
controller should do (ask for GPUs, apply a placement). Pure (numpy); no Ray.

It places the running actors on the cluster's devices (elastic.locate_actors), forms the current placement, runs
elastic.control_step and, for a transition, the slots of the actors it starts. The controller applies the result
(request_resources, apply_placement) and logs `entry` for `expertmesh status`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .actor_slots import NodeResources
from .elastic import (
    ElasticConfig,
    ElasticState,
    actor_slots,
    actors_per_node,
    cluster_devices,
    control_step,
    current_placement,
    locate_actors,
)
from .replica_registry import ReplicaRegistry
from .router_gpus import RouterReservation, expert_nodes


@dataclass(frozen=True)
class ControlPass:
    entry: dict  # the control log's entry: reason, imbalance before/after, replicas before/after, window_slots
    request_gpus: int | None = None  # GPU bundles the autoscale policy wants requested (None: leave as is)
    placement: dict[str, list] | None = None  # the whole new placement to apply live (None: keep the current one)
    new_slots: dict[str, dict] | None = None  # ActorSlot fields of the actors that placement adds


def control_pass(now: float, snapshot: dict, alive: Sequence[dict], reservation: RouterReservation,
                 registry: ReplicaRegistry, state: ElasticState, config: ElasticConfig
                 ) -> tuple[ControlPass, ElasticState]:
    """snapshot: the merged load (cluster/load_stats.py: "layers", "num_experts", "counts"."shard_load" [layers,
    experts]); alive: ray.nodes() entries of the live nodes; now: time.monotonic() (the autoscaler's cooldowns)."""
    layer_ids = list(snapshot["layers"])
    load = np.asarray(snapshot["counts"]["shard_load"], dtype=np.float64)  # [layers, experts]
    nodes = [NodeResources(n["NodeID"], n["Resources"].get("CPU", 0.0), int(n["Resources"].get("GPU", 0)))
             for n in alive]
    devices = cluster_devices(expert_nodes(nodes, reservation), config.slots_per_gpu)
    reg = registry
    running = {n: [tuple(x) for x in sh] for n, sh in reg.spec.actor_shards.items() if n not in reg.drained}
    actor_device = locate_actors(running, reg.slots, reg.nodes, reg.restoring, devices)
    if isinstance(actor_device, str):
        return ControlPass({"reason": actor_device}), state
    current = current_placement(running, actor_device, devices, layer_ids, int(snapshot["num_experts"]))
    outcome, state = control_step(now, load, current, running, layer_ids, state, config)
    entry = {"reason": outcome.reason, "imbalance_before": outcome.imbalance_before,
             "imbalance_after": outcome.imbalance_after, "replicas_before": outcome.replicas_before,
             "replicas_after": outcome.replicas_after, "window_slots": float(load.sum())}
    if outcome.transition is None:
        return ControlPass(entry, outcome.request_gpus), state
    step = outcome.transition
    slots = actor_slots(step.start, devices, config, actors_per_node(actor_device, devices))
    return ControlPass(entry, outcome.request_gpus, step.actors, {n: asdict(s) for n, s in slots.items()}), state
