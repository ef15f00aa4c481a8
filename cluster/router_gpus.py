"""Which GPUs the router replicas keep: the whole GPUs (and the CPUs) the expert pool must leave free so that every
Serve router replica that has to place at start finds room. Pure arithmetic; no Ray.

The rule (README: Placement, GPUs and threads):

  - Replicas that must place at start: `router.replicas`, or the minimum of `router.autoscale`. Replicas the Serve
    autoscaler adds beyond that take whatever whole GPUs Ray has free, or wait for Ray's autoscaler to add a node,
    like any other demand; nothing is kept for them.
  - `router.gpus` g >= 1 (a whole number): each replica keeps g whole GPUs of one node. 0 < g < 1: replicas pack
    floor(1/g) to a GPU, so ceil(replicas / floor(1/g)) whole GPUs are kept (not ceil(g x replicas): Ray never splits
    one replica's share over two GPUs, so 5 replicas of 0.4 need 3 GPUs, not 2). A kept GPU is always whole: no
    expert takes a share of it.
  - Where: one unit at a time (a replica's GPUs, or a GPU of packed fractional replicas), onto the GPU node with the
    fewest GPUs still unkept that holds the unit (best fit; ties by node id), after the nodes in `prefer`. So a
    dedicated 1-GPU router node (aws-gpu.yaml's g6e.xlarge) takes the router, and a single 8-GPU node keeps its GPUs
    for the router and gives the rest to the experts. Each unit also keeps the replicas' CPUs on its node.
  - The expert pool then plans onto what is left (`expert_nodes`): its actors' GPU fractions pack onto at most the
    node's GPUs less the kept ones (Ray packs fractional requests best-fit, equal fractions fill a GPU before
    starting the next), and Ray gives a whole-GPU request only a GPU with nothing on it. So Ray places the router
    replica on a kept GPU with no reservation object of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from .actor_slots import NodeResources

_EPS = 1e-9  # 1 / 0.2 is 4.999...; a tolerance keeps floor(1/g) honest


def replicas_at_start(replicas: int, autoscale: tuple[int, int] | None) -> int:
    """Router replicas that must place when the mesh starts: the fixed count, or the autoscaling minimum."""
    return autoscale[0] if autoscale is not None else replicas


def replicas_per_gpu(gpus_per_replica: float) -> int:
    """Router replicas one GPU holds: floor(1/g) for a fraction, 1 for a whole GPU or more."""
    assert gpus_per_replica > 0
    return max(1, math.floor(1 / gpus_per_replica + _EPS)) if gpus_per_replica < 1 else 1


def router_units(gpus_per_replica: float, replicas: int) -> list[tuple[int, int]]:
    """[(whole GPUs, replicas)] per unit of placement: a replica's g whole GPUs (g >= 1), or one GPU holding up to
    floor(1/g) fractional replicas. Empty when the routers compute on the CPU (g == 0) or none must place."""
    if gpus_per_replica <= 0 or replicas <= 0:
        return []
    if gpus_per_replica >= 1:
        return [(int(round(gpus_per_replica)), 1)] * replicas
    per = replicas_per_gpu(gpus_per_replica)
    return [(1, min(per, replicas - start)) for start in range(0, replicas, per)]


def router_gpu_count(gpus_per_replica: float, replicas: int) -> int:
    """Whole GPUs kept for `replicas` router replicas of `gpus_per_replica` each."""
    return sum(gpus for gpus, _ in router_units(gpus_per_replica, replicas))


@dataclass(frozen=True)
class RouterReservation:
    """What the expert pool leaves to the router replicas."""

    gpus_per_replica: float
    replicas: int  # router replicas that must place at start
    gpus: dict[str, int] = field(default_factory=dict)  # node id -> whole GPUs kept
    cpus: dict[str, float] = field(default_factory=dict)  # node id -> CPUs kept (the replicas' num_cpus)
    unplaced: int = 0  # replicas no node had room for (no GPU node, or too small ones)

    @property
    def total_gpus(self) -> int:
        return sum(self.gpus.values())

    @property
    def placed(self) -> int:
        return self.replicas - self.unplaced

    def as_dict(self) -> dict:
        return {"gpus_per_replica": self.gpus_per_replica, "replicas": self.replicas, "gpus": dict(self.gpus),
                "cpus": dict(self.cpus), "unplaced": self.unplaced}

    @classmethod
    def from_dict(cls, data: dict | None) -> RouterReservation:
        if not data:
            return NO_RESERVATION
        return cls(float(data["gpus_per_replica"]), int(data["replicas"]), {k: int(v) for k, v in data["gpus"].items()},
                   {k: float(v) for k, v in data["cpus"].items()}, int(data.get("unplaced", 0)))

    def describe(self) -> str:
        """e.g. '1 GPU of node 3f2a9c01 kept for 1 router replica x 1 GPU'."""
        if not self.gpus:
            return "no GPU kept for router replicas"
        where = ", ".join(f"{n} of node {node[:8]}" for node, n in sorted(self.gpus.items()))
        return (f"{self.total_gpus} GPU{'s' if self.total_gpus != 1 else ''} kept for {self.placed} router "
                f"replica{'s' if self.placed != 1 else ''} x {self.gpus_per_replica:g} GPU ({where})")


NO_RESERVATION = RouterReservation(0.0, 0)


def reserve_router_gpus(nodes: Iterable[NodeResources], gpus_per_replica: float, replicas: int,
                        cpus_per_replica: float = 0.0, prefer: Iterable[str] = ()) -> RouterReservation:
    """Keep whole GPUs (and CPUs) for `replicas` router replicas asking `gpus_per_replica` GPUs and
    `cpus_per_replica` CPUs each (the rule in the module docstring). prefer: node ids tried first (the nodes an
    earlier reservation used, so it does not move when the autoscaler adds a smaller node)."""
    assert gpus_per_replica >= 0 and replicas >= 0 and cpus_per_replica >= 0
    units = router_units(gpus_per_replica, replicas)
    if not units:
        return RouterReservation(gpus_per_replica, 0)
    preferred = set(prefer)
    free_gpus = {n.node_id: n.num_gpus for n in nodes if n.num_gpus > 0}
    free_cpus = {n.node_id: n.num_cpus for n in nodes if n.num_gpus > 0}
    kept_gpus: dict[str, int] = {}
    kept_cpus: dict[str, float] = {}
    unplaced = 0
    for gpus, count in units:
        cpus = cpus_per_replica * count
        fits = [node for node in free_gpus if free_gpus[node] >= gpus and free_cpus[node] + _EPS >= cpus]
        if not fits:
            unplaced += count
            continue
        node = min(fits, key=lambda n: (n not in preferred, free_gpus[n], n))
        free_gpus[node] -= gpus
        free_cpus[node] -= cpus
        kept_gpus[node] = kept_gpus.get(node, 0) + gpus
        kept_cpus[node] = kept_cpus.get(node, 0.0) + cpus
    return RouterReservation(gpus_per_replica, replicas, kept_gpus, kept_cpus, unplaced)


def expert_nodes(nodes: Iterable[NodeResources], reservation: RouterReservation) -> list[NodeResources]:
    """The nodes as the expert pool sees them: each less the GPUs and CPUs kept for router replicas. A node whose
    every GPU is kept has none for experts (and GPU pools skip GPU-less nodes)."""
    out = []
    for n in nodes:
        gpus = reservation.gpus.get(n.node_id, 0)
        cpus = reservation.cpus.get(n.node_id, 0.0)
        if gpus or cpus:
            n = replace(n, num_gpus=max(0, n.num_gpus - gpus), num_cpus=max(0.0, round(n.num_cpus - cpus, 6)))
        out.append(n)
    return out


def reservation_problem(nodes: Iterable[NodeResources], reservation: RouterReservation) -> str | None:
    """Why this reservation cannot serve, in one line (None when it can): router replicas with no room, or a GPU
    cluster whose every GPU went to the routers (the experts would silently fall back to CPU nodes)."""
    nodes = list(nodes)
    total = sum(n.num_gpus for n in nodes)
    asked = f"router.gpus {reservation.gpus_per_replica:g} x {reservation.replicas} replica" \
            f"{'s' if reservation.replicas != 1 else ''} at start"
    if reservation.unplaced:
        biggest = max((n.num_gpus for n in nodes), default=0)
        have = f"its largest GPU node has {biggest} GPUs" if total else "the cluster has no GPU"
        return (f"{asked}: {reservation.unplaced} router replica{'s' if reservation.unplaced != 1 else ''} "
                f"cannot be placed ({have}, or too few free CPUs beside them); give a GPU node with room, fewer "
                f"router replicas (router.replicas / the autoscale minimum), or router.gpus 0 (router on the CPU)")
    if total and reservation.total_gpus >= total:
        return (f"{asked} keeps every GPU of the cluster ({total}) and leaves none for the expert actors; give "
                f"more GPUs, fewer router replicas, or router.gpus 0 (router on the CPU)")
    return None
