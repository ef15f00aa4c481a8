"""Which node a restored or added expert actor goes to, and what room each live node has. Pure; no Ray.

Nodes come as `ray.nodes()` entries ({"NodeID", "Alive", "Resources": {"CPU", "GPU", ...}}) and free resources as
`available_resources_per_node()` ({node id: {"CPU": .., "GPU": ..}}); the controller reads both (they may lag a moment
behind starts and deaths) and passes them in.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from .actor_slots import ActorSlot
from .lost_restore import NodeRoom


def choose_node(slot: ActorSlot, alive: Sequence[dict], kept_gpus: Mapping[str, float],
                actor_nodes: Iterable[str]) -> str:
    """The slot's own node while it is alive; otherwise the live node (with GPUs, if the slot wants one) hosting the
    fewest of our actors (ties: the smallest id).

    kept_gpus: node -> GPUs kept for router replicas; they do not count, so a node whose every GPU is kept (a router
    node) is no GPU node. actor_nodes: the node of each of our actors (one entry per actor)."""
    if any(n["NodeID"] == slot.node_id for n in alive):
        return slot.node_id
    fits = [n for n in alive
            if (n["Resources"].get("GPU", 0) - kept_gpus.get(n["NodeID"], 0) > 0) == (slot.num_gpus > 0)
            and n["Resources"].get("CPU", 0) >= slot.num_cpus] or list(alive)
    actor_nodes = list(actor_nodes)
    load = {n["NodeID"]: sum(1 for v in actor_nodes if v == n["NodeID"]) for n in fits}
    return min(load, key=lambda node: (load[node], node))


def node_rooms(alive: Sequence[dict], available: Mapping[str, Mapping[str, float]],
               suspect: Collection[str]) -> list[NodeRoom]:
    """Live nodes, less the `suspect` ones (every actor of ours on them is lost), with what Ray has not given out."""
    return [NodeRoom(n["NodeID"], available.get(n["NodeID"], {}).get("CPU", 0.0),
                     available.get(n["NodeID"], {}).get("GPU", 0.0), n["Resources"].get("GPU", 0) > 0)
            for n in alive if n["NodeID"] not in suspect]
