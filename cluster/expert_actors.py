"""Starting one expert actor in its slot: the single place that turns (slot, pool spec) into a named Ray actor, used
by the pool when it starts (router_service/expert_pool.py) and by the controller when it restores or adds one."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..experts.actor import ExpertActor
from .actor_slots import ActorSlot
from .pool_spec import PoolSpec


def start_expert_actor(slot: ActorSlot, spec: PoolSpec, *, detached: bool, reuse: bool = False,
                       generation: int = 0, soft_affinity: bool = False) -> ray.actor.ActorHandle:
    """Start the actor `slot.name` on `slot.node_id` with the slot's CPUs and GPU fraction, hosting
    spec.actor_shards[slot.name]. Returns at once; the actor's `ready`/`info` answer once it loaded and warmed up.

    detached: it outlives the process that started it (Serve-config deployments, the controller's restores).
    reuse: adopt an actor that already runs under this name instead of failing.
    generation: 0 for the first actor of a name, +1 each time the controller restores it.
    soft_affinity: if that node is gone (ray.nodes() can still call it alive for a few seconds after it died),
        Ray places the actor on any node with room instead of failing it.
    """
    shards = [(int(layer), int(expert)) for layer, expert in spec.actor_shards[slot.name]]
    return ray.remote(ExpertActor).options(
        name=slot.name, namespace=spec.names.namespace, num_cpus=slot.num_cpus, num_gpus=slot.num_gpus,
        scheduling_strategy=NodeAffinitySchedulingStrategy(slot.node_id, soft=soft_affinity),
        lifetime="detached" if detached else None, get_if_exists=reuse,
    ).remote(slot.name, spec.model_dir, shards, spec.dtype, generation, tracing=spec.tracing,
             revision=spec.revision, memory_gb=spec.memory_gb, eviction=spec.eviction, quant=spec.quant,
             gpu_without_cuda=spec.gpu_without_cuda, mesh_id=spec.mesh_id)
