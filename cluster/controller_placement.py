"""Where the controller actor runs. Pure; no Ray (cluster/controller.py turns the choice into actor options).

The controller is the one actor whose loss delays every restore: its successor must start, read the record and probe
every actor before it restores anything. Left to Ray it lands on any node, including one that hosts experts; when
that node dies the restores wait for the controller too (measured: ~15 s more to detect a node loss). So it is placed
on purpose (`controller.placement`):

  head        the head node (Ray's `node:__internal_head__` resource; default). A cluster without its head is down
              anyway (its GCS is there), so the controller then dies with nothing it could have saved.
  no-experts  a live node that hosts no expert actor (soft node affinity, so a restarted controller still finds a
              node if that one died); the head when no such node exists.
  any         wherever Ray puts it (the old behaviour).

`controller.num_cpus` is what it reserves (default 0: the drill's head node has 1 CPU, which Serve's proxy and the
routers may need; the controller idles between 0.5 s passes). A reservation makes Ray keep that much CPU for it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

CONTROLLER_PLACEMENTS = ("head", "no-experts", "any")
HEAD_RESOURCE = "node:__internal_head__"  # every Ray >= 2.7 head node declares it (1.0)
HEAD_SHARE = 0.001  # how much of HEAD_RESOURCE the controller asks for: any share pins it to the head


@dataclass(frozen=True)
class ControllerPlacement:
    num_cpus: float
    resources: dict[str, float] = field(default_factory=dict)  # custom resources for ray.remote().options
    node_id: str | None = None  # node affinity (soft) when set
    reason: str = ""


def choose_controller_placement(placement: str, num_cpus: float, nodes: Sequence[Mapping],
                                expert_nodes: Collection[str]) -> ControllerPlacement:
    """placement: controller.placement; num_cpus: controller.num_cpus; nodes: `ray.nodes()` entries; expert_nodes:
    nodes hosting expert actors now. -> the actor options to use, and why."""
    if placement not in CONTROLLER_PLACEMENTS:
        raise ValueError(f"controller.placement: must be one of {CONTROLLER_PLACEMENTS}, got {placement!r}")
    if placement == "any":
        return ControllerPlacement(num_cpus, reason="any node (controller.placement any)")
    alive = [n for n in nodes if n.get("Alive")]
    has_head = any(n.get("Resources", {}).get(HEAD_RESOURCE, 0) > 0 for n in alive)
    if placement == "no-experts":
        busy = set(expert_nodes)
        # Prefer the head among the free nodes (it goes last in a cluster), then the most free CPUs.
        free = [n for n in alive if n["NodeID"] not in busy
                and n.get("Resources", {}).get("CPU", 0.0) + 1e-9 >= num_cpus]
        if free:
            best = min(free, key=lambda n: (-(n.get("Resources", {}).get(HEAD_RESOURCE, 0) > 0),
                                            -n.get("Resources", {}).get("CPU", 0.0), n["NodeID"]))
            return ControllerPlacement(num_cpus, node_id=best["NodeID"],
                                       reason=f"node {best['NodeID'][:12]} hosts no expert actor")
        if not has_head:
            return ControllerPlacement(num_cpus, reason="every node hosts expert actors and none is the head: any")
        return ControllerPlacement(num_cpus, {HEAD_RESOURCE: HEAD_SHARE},
                                   reason="every node hosts expert actors: the head node")
    if not has_head:  # an old Ray, or a snapshot without resources: do not make the actor unschedulable
        return ControllerPlacement(num_cpus, reason=f"no node declares {HEAD_RESOURCE}: any node")
    return ControllerPlacement(num_cpus, {HEAD_RESOURCE: HEAD_SHARE}, reason="the head node")
