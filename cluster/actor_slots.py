"""Actor slots: where each expert actor starts (node, CPUs, GPU fraction). Pure functions; no Ray.

Ray cannot pin an actor to a GPU index, only to a node and a GPU fraction; it then packs fractions onto GPUs. So the
plan fixes, per actor, its node and a fraction 1/m where m actors share each GPU of that node, which makes Ray's
packing land exactly m actors on every GPU. Replicas of one group go to different GPUs and, where possible,
different nodes, so a lost GPU or node leaves a live replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeResources:
    node_id: str
    num_cpus: float
    num_gpus: int = 0


@dataclass(frozen=True)
class ActorSlot:
    """Where one expert actor goes and what it asks Ray for."""

    name: str
    node_id: str
    num_cpus: float
    num_gpus: float  # 0 on CPU-only nodes; a fraction 1/m when m actors share a GPU
    gpu_slot: int | None  # index into the node's GPUs this plan intends (Ray's packing realises it); None on CPU


def plan_actor_slots(
    names: list[str],
    nodes: list[NodeResources],
    num_cpus_per_actor: float | None = None,
    cpu_budget_fraction: float = 1.0,
) -> list[ActorSlot]:
    """names: actors in the order replicas should spread (consecutive names land on different GPUs/nodes).

    With any GPU in the cluster, actors go only to GPU nodes, round-robin over GPUs interleaved across nodes. With
    none, they go round-robin over nodes. num_cpus_per_actor None shares each node's CPUs (times
    cpu_budget_fraction) among its actors, at most one CPU each.
    """
    assert names, "no actors to place"
    assert nodes, "no nodes to place onto"
    assert 0 < cpu_budget_fraction <= 1
    gpus = _interleaved_gpus(nodes)
    if gpus:
        targets = [(node, slot) for node, slot in gpus]
        assignment = [targets[i % len(targets)] for i in range(len(names))]
    else:
        targets = [(node, None) for node in sorted(nodes, key=lambda n: n.node_id)]
        assignment = _cpu_round_robin(targets, len(names), num_cpus_per_actor)

    per_node: dict[str, int] = {}
    per_gpu: dict[tuple[str, int], int] = {}
    for node, slot in assignment:
        per_node[node.node_id] = per_node.get(node.node_id, 0) + 1
        if slot is not None:
            per_gpu[(node.node_id, slot)] = per_gpu.get((node.node_id, slot), 0) + 1

    slots = []
    for name, (node, slot) in zip(names, assignment):
        if num_cpus_per_actor is None:
            share = node.num_cpus * cpu_budget_fraction / per_node[node.node_id]
            # Hundredths keep it readable; round first so float error (0.58 * 100 = 57.999…) does not cost a hundredth.
            cpus = math.floor(round(min(1.0, share) * 100, 6)) / 100
            if cpus <= 0:
                raise ValueError(f"node {node.node_id} has too few CPUs for {per_node[node.node_id]} expert actors")
        else:
            cpus = num_cpus_per_actor
        gpu_share = 0.0
        if slot is not None:
            sharing = max(per_gpu[(node.node_id, s)] for s in range(node.num_gpus) if (node.node_id, s) in per_gpu)
            gpu_share = 1.0 / sharing
        slots.append(ActorSlot(name=name, node_id=node.node_id, num_cpus=cpus, num_gpus=gpu_share, gpu_slot=slot))
    return slots


def _cpu_round_robin(targets: list[tuple[NodeResources, None]], count: int,
                     num_cpus_per_actor: float | None) -> list[tuple[NodeResources, None]]:
    """Round-robin over CPU nodes. With a fixed num_cpus_per_actor a node is skipped once it holds as many actors as
    its CPUs fit: plain round-robin put 7 actors of 0.5 CPU on a 1-CPU head among 8 workers, and the actors Ray
    could not place there (node affinity) never started. Only when every node is full does the rest overflow
    round-robin again (Ray then waits for room, as it would have)."""
    if num_cpus_per_actor is None:
        return [targets[i % len(targets)] for i in range(count)]
    room = {node.node_id: int(math.floor(node.num_cpus / num_cpus_per_actor + 1e-9)) for node, _ in targets}
    assignment: list[tuple[NodeResources, None]] = []
    i = 0
    while len(assignment) < count and any(room.values()):
        node, slot = targets[i % len(targets)]
        if room[node.node_id] > 0:
            room[node.node_id] -= 1
            assignment.append((node, slot))
        i += 1
    overflow = count - len(assignment)
    return assignment + [targets[i % len(targets)] for i in range(overflow)]


def _interleaved_gpus(nodes: list[NodeResources]) -> list[tuple[NodeResources, int]]:
    """[(node, gpu index)] ordered gpu0 of every node, then gpu1 of every node, ... (node ids sorted)."""
    gpu_nodes = sorted((n for n in nodes if n.num_gpus > 0), key=lambda n: n.node_id)
    most = max((n.num_gpus for n in gpu_nodes), default=0)
    return [(n, g) for g in range(most) for n in gpu_nodes if g < n.num_gpus]
