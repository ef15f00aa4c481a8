"""Where lost expert actors come back when the survivors have no room for them at their normal size. Pure; no Ray.

The plain restore starts a lost actor again under its own name, with its own CPU/GPU share, on a node with that much
free. When no live node has it (every share is given out, as after a node loss on a full cluster), `plan_restore`
re-plans the lost shards onto the survivors instead:

  1. an actor that fits somewhere at its normal share is restored as usual (`full`): on its own node while that is
     alive (Ray gives a dead actor's share back to its node, even if the free table does not show it yet) and no
     other plan's placement claim is on it (one may have taken that share: then its own node must show the room
     like any other), else on a node with that much free;
  2. an actor all of whose shards still have a live replica elsewhere waits for capacity (`deferred`): the shard runs
     with fewer replicas for a while, which costs nothing but headroom;
  3. every other lost actor gets a stand-in on a survivor: a new actor hosting its shards with a smaller share of
     what the node has free (`stand_ins`, one per lost actor: "shrunk"); when that share would fall under
     `min_cpus`, the lost actors on that node merge into fewer stand-ins that each get at least `min_cpus`, or one
     stand-in with whatever is left ("merged"; with nothing left it runs unreserved, on the CPU time the node has);
  4. `request` is the cluster shape to ask Ray's autoscaler for: one bundle per actor at its normal share.

When capacity arrives, `plan_return` says which of the displaced actors (stood in for, or deferred) fit back at their
normal share, a whole stand-in's worth at a time, so the controller can start them under their own names and retire
the stand-in. Both prefer a node that holds no live replica of the same shards, so a second node loss does not take
every replica of a shard.

    plan = plan_restore(lost, rooms, live_nodes, normal, stand_in_name)
    back = plan_return({"expert-s1": [lost_a, lost_b]}, rooms, live_nodes)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .actor_slots import ActorSlot
from .routing_table import Shard

_EPS = 1e-9


@dataclass(frozen=True)
class NodeRoom:
    """A live node and what Ray has not given out on it."""

    node_id: str
    free_cpus: float
    free_gpus: float = 0.0
    has_gpus: bool = False  # the node declares GPUs at all (a GPU slot never goes to a node without)
    # What live placement claims of actors new to this node hold there, already taken out of free_* (with the claims
    # of actors restarting in their own share: cluster/placement_claims.py). Such a plan may have put its actor into
    # a lost actor's returned share, so the lost actor's own node is no longer sure to have room for it.
    claimed_cpus: float = 0.0
    claimed_gpus: float = 0.0


@dataclass(frozen=True)
class LostActor:
    slot: ActorSlot  # its normal slot (name, share) on the node it last ran on, which may be gone
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class StandIn:
    """A new actor serving lost actors' shards, smaller than they were, until they come back at their normal size."""

    slot: ActorSlot
    shards: tuple[Shard, ...]
    replaces: tuple[str, ...]  # the lost actors whose shards it hosts


@dataclass(frozen=True)
class RestorePlan:
    full: dict[str, ActorSlot] = field(default_factory=dict)  # lost actor -> its normal share on a node with room
    stand_ins: dict[str, StandIn] = field(default_factory=dict)  # new actor name -> what it hosts and replaces
    deferred: tuple[str, ...] = ()  # lost actors whose every shard has a live replica elsewhere: wait for room
    request: tuple[dict[str, float], ...] = ()  # bundles for Ray's autoscaler; () when everything is back in full
    reason: str = ""

    @property
    def displaced(self) -> list[str]:
        """Lost actors that are not back at their normal size (stood in for or deferred)."""
        return sorted({n for s in self.stand_ins.values() for n in s.replaces} | set(self.deferred))


def bundle(slot: ActorSlot) -> dict[str, float]:
    """What one actor asks Ray for, as a request_resources bundle."""
    out = {"CPU": slot.num_cpus}
    if slot.num_gpus > 0:
        out["GPU"] = slot.num_gpus
    return out


def plan_restore(lost: Sequence[LostActor], rooms: Sequence[NodeRoom], live_nodes: Mapping[Shard, Collection[str]],
                 normal: Sequence[ActorSlot], stand_in_name: Callable[[int], str],
                 min_cpus: float = 0.1, home_taken: Collection[str] = ()) -> RestorePlan:
    """lost: the actors to bring back; rooms: the live nodes; live_nodes: shard -> nodes that hold a live replica of
    it now; normal: every other actor of the normal placement at its normal slot (for the request);
    stand_in_name(i): the name of the i-th stand-in (0, 1, ...); min_cpus: the least CPU share worth its own actor;
    home_taken: lost actors whose restart on their own node waited unplaced (another actor had their returned share):
    they fit by free room like anywhere else."""
    assert min_cpus > 0, "min_cpus must be > 0"
    free = {r.node_id: [r.free_cpus, r.free_gpus] for r in rooms}
    hosted = {r.node_id: set() for r in rooms}  # shards each node holds a live (or planned) replica of
    for shard, nodes in live_nodes.items():
        for node in nodes:
            if node in hosted:
                hosted[node].add(tuple(shard))
    full = _place_full(sorted(lost, key=lambda a: a.slot.name), rooms, free, hosted, home_fits=True,
                       home_taken=home_taken)
    rest = [a for a in sorted(lost, key=lambda a: a.slot.name) if a.slot.name not in full]
    deferred = tuple(a.slot.name for a in rest if all(live_nodes.get(tuple(s)) for s in a.shards))
    needy = [a for a in rest if a.slot.name not in deferred]
    stand_ins: dict[str, StandIn] = {}
    if needy and rooms:
        per_node: dict[str, list[LostActor]] = {}
        for actor in needy:  # spread over the survivors of its kind (GPU or not), away from replicas of its shards
            kind = [r for r in rooms if r.has_gpus == (actor.slot.num_gpus > 0)] or list(rooms)
            node = min(kind, key=lambda r: (_overlap(actor.shards, hosted[r.node_id]),
                                             len(per_node.get(r.node_id, [])), -free[r.node_id][0], r.node_id))
            per_node.setdefault(node.node_id, []).append(actor)
            hosted[node.node_id].update(map(tuple, actor.shards))
        has_gpus = {r.node_id: r.has_gpus for r in rooms}
        for node in sorted(per_node):
            groups = _groups(per_node[node], free[node][0], min_cpus)
            for group in groups:
                count = len(groups)
                cpus = _hundredths(free[node][0] / count)
                wants_gpu = has_gpus[node] and any(a.slot.num_gpus > 0 for a in group)
                gpus = _hundredths(free[node][1] / count) if wants_gpu else 0.0
                name = stand_in_name(len(stand_ins))
                shards = tuple(sorted({tuple(s) for a in group for s in a.shards}))
                slot = ActorSlot(name=name, node_id=node, num_cpus=cpus, num_gpus=gpus,
                                 gpu_slot=group[0].slot.gpu_slot if gpus > 0 else None)
                stand_ins[name] = StandIn(slot, shards, tuple(a.slot.name for a in group))
    elif needy:
        deferred = deferred + tuple(a.slot.name for a in needy)  # no live node at all: nothing to stand in on
    degraded = bool(stand_ins or deferred)
    request = tuple(bundle(s) for s in sorted([*normal, *(a.slot for a in lost)], key=lambda s: s.name)) \
        if degraded else ()
    return RestorePlan(full, stand_ins, deferred, request, _reason(full, stand_ins, deferred))


def plan_return(displaced: Mapping[str, Sequence[LostActor]], rooms: Sequence[NodeRoom],
                live_nodes: Mapping[Shard, Collection[str]]) -> dict[str, dict[str, ActorSlot]]:
    """displaced: group -> the lost actors that come back together (a stand-in's name -> the actors it replaces; a
    deferred actor's own name -> [it]). -> group -> {actor: its normal slot on a node with room now}, for every group
    whose actors all fit (groups in name order take room first). Room a stand-in holds does not count: the actors
    start before it stops."""
    free = {r.node_id: [r.free_cpus, r.free_gpus] for r in rooms}
    hosted = {r.node_id: set() for r in rooms}
    for shard, nodes in live_nodes.items():
        for node in nodes:
            if node in hosted:
                hosted[node].add(tuple(shard))
    back = {}
    for group in sorted(displaced):
        actors = sorted(displaced[group], key=lambda a: a.slot.name)
        trial_free = {n: list(v) for n, v in free.items()}
        trial_hosted = {n: set(v) for n, v in hosted.items()}
        placed = _place_full(actors, rooms, trial_free, trial_hosted, home_fits=False)
        if len(placed) == len(actors):
            back[group] = placed
            free, hosted = trial_free, trial_hosted
    return back


def _place_full(actors: Sequence[LostActor], rooms: Sequence[NodeRoom], free: dict[str, list[float]],
                hosted: dict[str, set], home_fits: bool, home_taken: Collection[str] = ()) -> dict[str, ActorSlot]:
    """Each actor that fits somewhere at its normal share: with home_fits, on its own node while that is alive and
    unclaimed and the actor is not in home_taken (the share it held comes back there; `free` may go below 0 until
    Ray's table shows it), else on the fitting node with no replica of its shards if any, then the most free CPU;
    `free` and `hosted` are updated in place."""
    placed = {}
    alive = {r.node_id: r for r in rooms}
    for actor in actors:
        slot = actor.slot
        home = alive.get(slot.node_id) if home_fits and slot.name not in home_taken else None
        if home is not None and (home.claimed_cpus > _EPS or home.claimed_gpus > _EPS):
            # A plan made since it died may have put an actor into its returned share (the CI chaos drill: the
            # node's re-plan took it and this in-place restore then waited PENDING): fit by what is left instead.
            home = None
        fits = [home] if home is not None and (slot.num_gpus <= 0 or home.has_gpus) else [
            r for r in rooms if free[r.node_id][0] + _EPS >= slot.num_cpus
            and (slot.num_gpus <= 0 or (r.has_gpus and free[r.node_id][1] + _EPS >= slot.num_gpus))]
        if not fits:
            continue
        node = min(fits, key=lambda r: (_overlap(actor.shards, hosted[r.node_id]), -free[r.node_id][0],
                                        r.node_id)).node_id
        free[node][0] -= slot.num_cpus
        free[node][1] -= slot.num_gpus
        hosted[node].update(map(tuple, actor.shards))
        placed[slot.name] = replace(slot, node_id=node)
    return placed


def _groups(actors: list[LostActor], free_cpus: float, min_cpus: float) -> list[list[LostActor]]:
    """One stand-in per actor while each gets ≥ min_cpus of free_cpus; else as many as get that (at least one), the
    actors dealt round-robin among them."""
    count = len(actors)
    if _hundredths(free_cpus / count) + _EPS < min_cpus:
        count = max(1, min(count, math.floor(free_cpus / min_cpus + _EPS)))
    return [actors[i::count] for i in range(count)]


def _overlap(shards: Sequence[Shard], hosted: set) -> int:
    return sum(1 for s in shards if tuple(s) in hosted)


def _hundredths(value: float) -> float:
    """Round down to hundredths (round first so 0.58 * 100 = 57.999... does not cost a hundredth); never negative."""
    return max(0.0, math.floor(round(value * 100, 6)) / 100)


def _reason(full: Mapping, stand_ins: Mapping[str, StandIn], deferred: Sequence[str]) -> str:
    parts = []
    if full:
        parts.append(f"restored {len(full)} at their normal share")
    shrunk = [s for s in stand_ins.values() if len(s.replaces) == 1]
    merged = [s for s in stand_ins.values() if len(s.replaces) > 1]
    if shrunk:
        parts.append(f"{len(shrunk)} on smaller shares")
    if merged:
        parts.append(f"{sum(len(s.replaces) for s in merged)} merged into {len(merged)}")
    if deferred:
        parts.append(f"{len(deferred)} deferred (their shards have live replicas elsewhere)")
    return "; ".join(parts) or "nothing lost"
