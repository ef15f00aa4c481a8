"""Greedy replicate-then-pack: the global policy of DeepSeek's EPLB, on expertmesh's shard model. Pure (numpy).

It is both the baseline the planner must match (`greedy_plan`) and the planner's first candidate (the two building
blocks below). The one difference from EPLB: a GPU never hosts two replicas of one shard (a replica is an actor's
copy of the weights; two on one GPU would split nothing), so packing skips GPUs that already host the shard.

1. replicate_counts: give the extra replicas one at a time to the shard with the highest load per replica (this
   minimises the heaviest replica, like EPLB's replicate_experts).
2. pack_greedy: heaviest replica first onto the least loaded GPU that has a free slot and does not host the shard
   yet (EPLB's balanced_packing with a capacity of slots_per_gpu per GPU per layer).
"""

from __future__ import annotations

import numpy as np

from .shard_placement import Placement, Topology, _check_load


def replica_budget(topology: Topology, experts: int, extra_replicas: int | None) -> int:
    """Replicas per layer: one per expert plus `extra_replicas` (None: fill every live slot), within what fits."""
    room = topology.num_live * min(topology.slots_per_gpu, experts)
    if experts > room:
        raise ValueError(f"slots_per_gpu: {topology.num_live} live GPUs x {topology.slots_per_gpu} slots cannot "
                         f"hold {experts} experts per layer")
    if extra_replicas is None:
        return room
    if extra_replicas < 0:
        raise ValueError(f"extra_replicas: must be ≥ 0, got {extra_replicas}")
    return min(room, experts + extra_replicas)


def replicate_counts(load: np.ndarray, total: int, cap: int) -> np.ndarray:
    """load: [layers, experts], total: replicas per layer (≥ experts), cap: most replicas one shard may have.

    Returns counts: [layers, experts] ≥ 1, each row summing to `total`, minimising max(load / counts) greedily.
    Ties go to the lower expert id.
    """
    layers, experts = load.shape
    assert experts <= total <= experts * cap, f"{total} replicas for {experts} experts with at most {cap} each"
    counts = np.ones((layers, experts), dtype=np.int64)
    rows = np.arange(layers)
    for _ in range(total - experts):
        per_replica = np.where(counts < cap, load / counts, -np.inf)
        counts[rows, per_replica.argmax(axis=1)] += 1
    return counts


def replica_items(load: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every replica as an item, heaviest first. load, counts: [layers, experts] -> (expert [layers, P],
    weight [layers, P]) with P = the most replicas of any layer; a layer with fewer is padded with expert -1
    (weight -inf) at the end; equal weights keep the lower expert id first."""
    layers, experts = load.shape
    per_layer = counts.sum(axis=1)
    most = int(per_layer.max())
    # Pad each layer to `most` items with a dummy column (id `experts`) that sorts last.
    padded = np.concatenate([counts, (most - per_layer)[:, None]], axis=1)
    expert = np.repeat(np.tile(np.arange(experts + 1), layers), padded.ravel()).reshape(layers, most)
    per = np.concatenate([load / counts, np.full((layers, 1), -np.inf)], axis=1)
    weight = np.take_along_axis(per, expert, axis=1)
    order = np.argsort(-weight, axis=1, kind="stable")
    expert = np.take_along_axis(expert, order, axis=1)
    return np.where(expert == experts, -1, expert), np.take_along_axis(weight, order, axis=1)


def pack_greedy(expert: np.ndarray, per_replica: np.ndarray, topology: Topology,
                initial: np.ndarray | None = None, prefer: np.ndarray | None = None,
                bound: np.ndarray | None = None, open_gpus: np.ndarray | None = None) -> np.ndarray:
    """expert: [layers, P] replicas in the order to place (heaviest first; -1 = nothing, for layers with fewer);
    per_replica: [layers, experts] the load of one replica of each shard; initial: [layers, num_gpus,
    slots_per_gpu] shards already placed (each GPU row filled from the left), default none. Each replica goes to the
    least loaded live GPU with a free slot that does not host its shard yet (lowest GPU index on ties).

    prefer: [layers, num_gpus, experts] bool, bound: [layers] (the planner's sticky mode): a replica goes instead to
    the least loaded preferred GPU (one that hosted the shard before) if it stays ≤ bound there.
    open_gpus: [layers, num_gpus] bool, default all: only these GPUs take replicas.

    Returns slots: [layers, num_gpus, slots_per_gpu] (-1 = empty).
    """
    layers, items = expert.shape
    experts = per_replica.shape[1]
    gpus, cap = topology.num_gpus, topology.slots_per_gpu
    rows = np.arange(layers)
    if initial is None:
        slots = np.full((layers, gpus, cap), -1, dtype=np.int64)
    else:
        slots = np.array(initial, dtype=np.int64)
        assert slots.shape == (layers, gpus, cap)
    weight = np.concatenate([per_replica, np.zeros((layers, 1))], axis=1)  # column `experts` = empty slot
    idx = np.where(slots < 0, experts, slots)
    loads = np.take_along_axis(weight, idx.reshape(layers, -1), axis=1).reshape(idx.shape).sum(axis=-1)
    fill = (slots >= 0).sum(axis=-1)
    assert ((slots[..., 1:] >= 0) <= (slots[..., :-1] >= 0)).all(), "initial: rows must be filled from the left"
    fill[:, ~topology.live] = cap  # failed GPUs have no room
    if open_gpus is not None:
        fill = np.where(open_gpus, fill, cap)
    assert ((expert >= 0).sum(axis=1) <= (cap - fill).sum(axis=1)).all(), "more replicas than free live slots"
    hosted = np.zeros((layers, experts + 1, gpus), dtype=bool)  # [layer, shard, gpu]: contiguous per-shard rows
    hosted[rows[:, None, None], idx, np.arange(gpus)[None, :, None]] = True
    hosted[:, experts] = False
    score = np.where(fill < cap, loads, np.inf)  # what a GPU offers: its load, or inf when full
    if prefer is not None:
        assert bound is not None and prefer.shape == (layers, gpus, experts)
        prefer = np.concatenate([prefer.transpose(0, 2, 1), np.zeros((layers, 1, gpus), dtype=bool)], axis=1)
    for k in range(items):
        e = expert[:, k]
        r = rows
        if (e < 0).any():
            r = rows[e >= 0]
            e = e[r]
            if not len(r):
                continue
        cand = np.where(hosted[r, e], np.inf, score[r])
        g = cand.argmin(axis=1)
        if prefer is not None:
            fits = np.where(prefer[r, e] & (cand + per_replica[r, e][:, None] <= bound[r, None]), cand, np.inf)
            home = fits.argmin(axis=1)
            g = np.where(np.isfinite(fits[np.arange(len(r)), home]), home, g)
        stuck = np.isinf(cand[np.arange(len(r)), g])
        for i in np.flatnonzero(stuck):
            g[i] = _make_room(int(r[i]), int(e[i]), slots, fill, hosted, loads, per_replica[r[i]], cap)
            score[r[i]] = np.where(fill[r[i]] < cap, loads[r[i]], np.inf)
        slots[r, g, fill[r, g]] = e
        fill[r, g] += 1
        loads[r, g] += per_replica[r, e]
        score[r, g] = np.where(fill[r, g] < cap, loads[r, g], np.inf)
        hosted[r, e, g] = True
    return slots


def _make_room(layer: int, e: int, slots: np.ndarray, fill: np.ndarray, hosted: np.ndarray, loads: np.ndarray,
               weight: np.ndarray, cap: int) -> int:
    """Every GPU with a free slot already hosts shard e (rare, late in packing). Move a shard x from the least
    loaded full GPU g without e to a GPU h with room; e then takes x's slot on g. Such an x exists: if h hosted all
    `cap` shards of g it would be full. Returns g, with one slot freed. weight: [experts] load per replica."""
    room = np.flatnonzero(fill[layer] < cap)
    assert len(room), "no free slot left"
    without = np.flatnonzero(~hosted[layer, e] & (fill[layer] == cap) & (slots[layer, :, 0] >= 0))
    assert len(without), f"shard (layer={layer}, expert={e}) has more replicas than live GPUs"
    g = int(without[loads[layer, without].argmin()])
    for h in room:
        for s in range(cap):
            x = int(slots[layer, g, s])
            if hosted[layer, x, h]:
                continue
            slots[layer, h, fill[layer, h]] = x
            fill[layer, h] += 1
            hosted[layer, x, h], hosted[layer, x, g] = True, False
            loads[layer, h] += weight[x]
            loads[layer, g] -= weight[x]
            slots[layer, g, s:cap - 1] = slots[layer, g, s + 1:cap].copy()
            slots[layer, g, cap - 1] = -1
            fill[layer, g] -= 1
            return g
    raise AssertionError("unreachable: a movable shard always exists")


def greedy_plan(load: np.ndarray, topology: Topology, extra_replicas: int | None = None,
                replicas: np.ndarray | None = None) -> Placement:
    """EPLB's global policy. load: [layers, experts]; extra_replicas per layer (None: fill every live slot);
    replicas: [layers, experts] counts to pack instead of water-filling ones."""
    load = np.asarray(load, dtype=np.float64)
    assert load.ndim == 2, "load: expected [layers, experts]"
    layers, experts = load.shape
    load = _check_load(load, layers, experts)
    if replicas is None:
        counts = replicate_counts(load, replica_budget(topology, experts, extra_replicas), topology.num_live)
    else:
        counts = np.asarray(replicas, dtype=np.int64)
    expert, _ = replica_items(load, counts)
    return Placement(topology, experts, pack_greedy(expert, load / counts, topology))
