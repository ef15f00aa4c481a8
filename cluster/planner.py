"""Placement planner: how many replicas each shard gets and on which GPU. Pure (numpy); no Ray.

Objective, per MoE layer (layers run one after another, so each layer's slowest GPU counts; see shard_placement):
  1. minimise the most loaded live GPU (GPU load = sum of load / replicas of the shards it hosts),
  2. among plans whose peak is ≤ min(greedy's, ours x 1.02) x (1 + balance_slack) (balance_slack = 0: never worse
     than greedy), move the fewest shards: a move is a shard replica hosted on a GPU that did not host it in
     `current` (weights to load),
  3. hierarchy: spread each shard's replicas over different nodes (a node failure keeps a replica; each node's
     links carry a share of a hot shard) and balance the load per node, at no cost to 1.

How (vectorised over layers):
  a. replica counts: greedy water-filling (EPLB's replicate_experts) for the replica budget;
  b. greedy replicate-then-pack (EPLB's global policy, `eplb_greedy`), then a local search: swap a shard on the
     most loaded GPU with one (or an empty slot) on another GPU when that lowers the pair's maximum below the old
     peak, the best such swap per layer per round. It starts from greedy and only accepts such swaps, so its peak is
     never above greedy's, layer by layer. Partners: the 8 least loaded GPUs, then a short polish against all GPUs
     (which finds swaps with near-peak GPUs holding lighter shards, the case of very hot experts);
  b'. on small problems (search_counts), the same for other replica counts (count_candidates: per-GPU targets,
     spare replicas as near-zero "fillers" or by water-filling), the best per layer kept, then recount_search
     replaces a replica on the peak GPU by one of another shard while that lowers the peak. Water-filling balances
     replicas, not GPUs: with 2 slots per GPU a filler replica of an idle expert can let a hot replica sit alone;
  c. without `current`: the GPUs are permuted within each layer (free for balance) so bins go to nodes heaviest
     first, each to the node where its shards have the fewest replicas already, ties to the least loaded node;
  d. with `current`: repair it (empty failed GPUs, drop surplus replicas from the most loaded GPUs hosting them, add
     missing ones greedily) to the water-filling counts, to counts kept near the current ones (nearby_counts), and
     with the count search to the best plan's counts; run the local search (all partners) only until the layer's
     peak reaches the goal; per layer the repair under the goal with the fewest moves.
     Layers still above it get three candidates and keep the one under the goal with the fewest moves:
     the repair escaped from its local optimum by repacking its k most and k least loaded GPUs (k = 1, 2, 4, ...);
     a "sticky" greedy pack that keeps a replica on a GPU that hosted its shard when it fits under the goal (same
     search and escape); the from-scratch plan relabelled to overlap `current` most (greedy matching of GPU bins),
     which always qualifies.
"""

from __future__ import annotations

import numpy as np

from .eplb_greedy import pack_greedy, replica_budget, replica_items, replicate_counts
from .shard_placement import Placement, Topology, _check_load

# With `current`, a plan within this fraction of our best from-scratch balance (and never above greedy's) is good
# enough: the last percent or two of balance would cost many moves.
MOVE_SAVING = 0.02
# With `current`, replica counts stay as they are while their max load per replica is within this of the optimum:
# counts that follow every bit of noise each cost a move.
COUNT_SLACK = 0.03
# Above this many layers x experts x GPUs the planner keeps water-filling counts (the count search would cost several
# plans' time; at that scale the local search already balances within a percent or two).
SEARCH_COUNTS_UP_TO = 20_000


def plan(load: np.ndarray, topology: Topology, current: Placement | None = None,
         extra_replicas: int | None = None, balance_slack: float = 0.0, partners: int = 8,
         max_rounds: int | None = None, polish_rounds: int = 32, replicas: np.ndarray | None = None,
         search_counts: bool | None = None) -> Placement:
    """load: [layers, experts] shard load over a window; topology: nodes, GPUs, slots per GPU per layer, failed GPUs;
    current: the placement now serving (same layers and experts; GPUs matched by index) or None;
    extra_replicas: replicas per layer beyond one per expert (None: fill every live slot);
    balance_slack: with `current`, how far (a fraction) a move-saving plan's peak may exceed the goal of
      min(greedy's peak, our from-scratch peak x (1 + MOVE_SAVING)); 0 keeps every layer ≤ greedy's peak;
    partners: least loaded GPUs the first local search tries per step; max_rounds: its steps (default 4 x GPUs);
    polish_rounds: steps of the polish against every GPU;
    replicas: [layers, experts] replica counts to place (e.g. the autoscaler's decision.replicas) instead of
      choosing them; each ≥ 1 and ≤ live GPUs, each layer's sum ≤ live GPUs x slots_per_gpu (extra_replicas unused);
    search_counts: also pack other replica counts than water-filling (count_candidates) and keep, per layer, the
      best; default on for small problems (layers x experts x GPUs ≤ SEARCH_COUNTS_UP_TO), where few slots per GPU
      make the counts matter and the search is cheap.

    Returns a Placement: every shard ≥ 1 replica, at most one per GPU, ≤ slots_per_gpu per GPU per layer, none on
    failed GPUs, each layer's peak GPU load ≤ greedy replicate-then-pack's on the same input (x (1 + balance_slack)
    when `current` is given).
    """
    load = np.asarray(load, dtype=np.float64)
    assert load.ndim == 2, "load: expected [layers, experts]"
    layers, experts = load.shape
    load = _check_load(load, layers, experts)
    assert balance_slack >= 0 and partners >= 1
    rounds = 4 * topology.num_gpus if max_rounds is None else max_rounds
    if replicas is None:
        total = replica_budget(topology, experts, extra_replicas)
        counts = replicate_counts(load, total, topology.num_live)  # [L, E]
    else:
        counts = _check_replicas(replicas, layers, experts, topology)
    weight = load / counts  # [L, E] load of one replica
    order, _ = replica_items(load, counts)
    greedy = pack_greedy(order, weight, topology)
    greedy_peak = _peak(greedy, weight, topology)
    best = local_search(greedy, weight, topology, rounds=rounds, partners=partners)
    best_peak = _peak(best, weight, topology)
    if search_counts is None:
        search_counts = replicas is None and layers * experts * topology.num_gpus <= SEARCH_COUNTS_UP_TO
    if search_counts and replicas is None:
        for c in count_candidates(load, total, topology.num_live):
            trial = local_search(pack_greedy(replica_items(load, c)[0], load / c, topology), load / c, topology,
                                 rounds=rounds, partners=partners)
            peak = _peak(trial, load / c, topology)
            better = peak < best_peak * (1 - 1e-9)
            best[better], best_peak[better] = trial[better], peak[better]
    best_weight = load / np.maximum(_hosts(best, experts).sum(axis=1), 1)
    everyone = topology.num_live
    if current is None:
        # A short polish against every GPU finds swaps with near-peak GPUs that hold lighter shards (hot experts).
        best = local_search(best, best_weight, topology, rounds=polish_rounds, partners=everyone)
        if search_counts:
            best = recount_search(best, load, topology, rounds=polish_rounds)
            best_weight = load / _hosts(best, experts).sum(axis=1)
            best = local_search(best, best_weight, topology, rounds=polish_rounds, partners=everyone)
        return Placement(topology, experts, spread_over_nodes(best, best_weight, topology))

    assert (current.layers, current.experts) == (layers, experts), \
        f"current: placement of {current.layers} layers x {current.experts} experts, load is {layers} x {experts}"
    now = _fit_current(current, topology)
    goal = np.minimum(greedy_peak, best_peak * (1 + MOVE_SAVING)) * (1 + balance_slack)
    keep = _hosts(now, experts)
    # Repair with several count choices, per layer the one reaching the goal with the fewest moves: the
    # water-filling counts (first: layers nothing brings to the goal go on from this one), the current counts
    # wherever their max load per replica is within COUNT_SLACK of the optimum (fewer changes), and with the count
    # search the counts of the best plan found.
    optimum = weight.max(axis=1)  # the least possible max load per replica
    choices = [counts]
    if replicas is None:
        choices.append(nearby_counts(load, keep.sum(axis=1), total, topology.num_live,
                                     good_enough=optimum * (1 + COUNT_SLACK)))
    if search_counts:
        choices.append(_hosts(best, experts).sum(axis=1))
    out, ok, cost = None, None, None
    for c in choices:
        # Only the layers where these counts differ from the water-filling ones need another try.
        todo = np.arange(layers) if out is None else np.flatnonzero((c != counts).any(axis=1))
        if not len(todo):
            continue
        w_c = load[todo] / c[todo]
        slots = local_search(repair(now[todo], c[todo], w_c, topology), w_c, topology, rounds=rounds,
                             partners=everyone, target=goal[todo])
        reached, moved = _reached(slots, w_c, topology, goal[todo]), (_hosts(slots, experts) & ~keep[todo]).sum((1, 2))
        if out is None:
            out, ok, cost = slots, reached, moved
            continue
        use = reached & (~ok[todo] | (moved < cost[todo]))
        out[todo[use]], cost[todo[use]] = slots[use], moved[use]
        ok[todo] |= reached
    sub = np.flatnonzero(~ok)
    if not len(sub):
        return Placement(topology, experts, out)
    # Layers neither repair brought to the goal: three candidates each (water-filling counts), the one under the
    # goal with the fewest moves wins (the relabelled from-scratch plan always qualifies).
    w, g, keep = weight[sub], goal[sub], keep[sub]
    sticky = pack_greedy(order[sub], w, topology, prefer=keep, bound=g)
    sticky = local_search(sticky, w, topology, rounds=rounds, partners=everyone, target=g)
    polished = local_search(best[sub], best_weight[sub], topology, rounds=polish_rounds, partners=everyone)
    candidates = [match_gpus(polished, now[sub], topology),
                  _escape(out[sub], w, topology, g, rounds, everyone),
                  _escape(sticky, w, topology, g, rounds, everyone)]
    cost = np.stack([(_hosts(c, experts) & ~keep).sum(axis=(1, 2)) for c in candidates])  # [C, sub]
    ok = np.stack([_reached(c, w, topology, g) for c in candidates])
    ok[0] = True
    pick = np.where(ok, cost, np.iinfo(np.int64).max).argmin(axis=0)
    out[sub] = np.stack(candidates)[pick, np.arange(len(sub))]
    return Placement(topology, experts, out)


# ---- steps -------------------------------------------------------------------------------------------------------


def nearby_counts(load: np.ndarray, current: np.ndarray, total: int, cap: int,
                  good_enough: np.ndarray | None = None) -> np.ndarray:
    """Replica counts [L, E] summing to `total` per layer with the same (optimal) max load per replica as greedy
    water-filling, reached from `current` [L, E] by as few single-replica changes as possible: fix the total, then
    move one replica at a time from the shard that misses it least (min load / (c - 1)) to the one that needs it
    most (max load / c) while that lowers the peak. good_enough: [L] stop a layer once its max load per replica is
    at or below this (default: the optimum)."""
    layers, experts = load.shape
    c = np.clip(current, 1, cap).astype(np.int64)
    rows = np.arange(layers)
    for _ in range(experts * cap):
        diff = c.sum(axis=1) - total
        if not diff.any():
            break
        give = np.where(c > 1, load / np.maximum(c - 1, 1), np.inf).argmin(axis=1)  # loses least
        take = np.where(c < cap, load / c, -np.inf).argmax(axis=1)  # gains most
        c[rows[diff > 0], give[diff > 0]] -= 1
        c[rows[diff < 0], take[diff < 0]] += 1
    for _ in range(experts * cap):
        per = np.where(c < cap, load / c, -np.inf)
        take = per.argmax(axis=1)
        after = np.where(c > 1, load / np.maximum(c - 1, 1), np.inf)
        after[rows, take] = np.inf
        give = after.argmin(axis=1)
        # The layer's peak per replica is max(load / c) over all shards, capped ones included.
        peak = (load / c).max(axis=1)
        move = (per[rows, take] >= peak) & (after[rows, give] < per[rows, take] * (1 - 1e-12))
        if good_enough is not None:
            move &= peak > good_enough
        if not move.any():
            break
        c[rows[move], take[move]] += 1
        c[rows[move], give[move]] -= 1
    return c


def count_candidates(load: np.ndarray, total: int, cap: int) -> list[np.ndarray]:
    """Replica counts [L, E] other than water-filling, each summing to `total` per layer: every shard gets
    ceil(load / T) replicas for a per-GPU target T = f x (layer load / cap live GPUs), f in 1.05 .. 1.5, and the
    spare replicas go either to the lightest shards (near-zero "fillers", so a heavy replica can share its GPU with
    almost nothing) or by water-filling. A layer that needs more than `total` replicas for a given T keeps the
    water-filling counts."""
    layers, experts = load.shape
    rows = np.arange(layers)
    base = replicate_counts(load, total, cap)
    mean = load.sum(axis=1, keepdims=True) / cap
    out = []
    for f in (1.05, 1.1, 1.15, 1.2, 1.35, 1.5):
        need = np.clip(np.ceil(load / np.maximum(f * mean, 1e-300) - 1e-9), 1, cap).astype(np.int64)
        fits = need.sum(axis=1) <= total
        for fillers in (True, False):
            c = np.where(fits[:, None], need, base)
            for _ in range(int((total - c.sum(axis=1)).max())):
                spare = c.sum(axis=1) < total
                score = np.where(c < cap, -load / (c + 1) if fillers else load / c, -np.inf)
                c[rows[spare], score.argmax(axis=1)[spare]] += 1
            out.append(c)
    return out


def recount_search(slots: np.ndarray, load: np.ndarray, topology: Topology, rounds: int) -> np.ndarray:
    """Change replica counts where that lowers a layer's peak (water-filling counts balance replicas, not GPUs; with
    few slots per GPU other counts can pack better). Per round and layer: on the most loaded GPU h, replace a
    replica of a shard a (≥ 2 replicas) by a new replica of a shard b that h lacks, if max(h's new load, the new
    load of every other GPU hosting a) stays below h's load; GPUs hosting b only get lighter, so the peak never
    rises. slots: [L, G, S]; load: [L, E]."""
    slots = np.array(slots, dtype=np.int64)
    layers, gpus, cap = slots.shape
    experts = load.shape[1]
    dead = ~topology.live
    active = np.ones(layers, dtype=bool)
    for _ in range(rounds):
        act = np.flatnonzero(active)
        if not len(act):
            break
        sl = slots[act]
        n, ar = len(act), np.arange(len(act))
        idx = np.where(sl < 0, experts, sl)
        hosted = _hosts(sl, experts, pad=True)  # [n, G, E + 1]
        counts = hosted.sum(axis=1)[:, :experts]  # [n, E]
        ld = load[act]
        weight = ld / np.maximum(counts, 1)
        loads = np.where(dead, -np.inf, _loads(sl, weight))
        h = loads.argmax(axis=1)
        peak = loads[ar, h]
        a = idx[ar, h]  # [n, S]
        ca = np.take_along_axis(np.concatenate([counts, np.zeros((n, 1), np.int64)], 1), a, axis=1)
        la = np.take_along_axis(np.concatenate([ld, np.zeros((n, 1))], 1), a, axis=1)
        droppable = (a < experts) & (ca >= 2)
        wa = np.where(droppable, la / np.maximum(ca, 1), 0.0)
        rise = np.where(droppable, la / np.maximum(ca - 1, 1) - wa, 0.0)  # on each other GPU hosting a
        others = np.where(dead, -np.inf, loads).copy()
        others[ar, h] = -np.inf
        host_a = np.take_along_axis(hosted, np.broadcast_to(a[:, None, :], (n, gpus, cap)), axis=2)  # [n, G, S]
        a_max = np.where(host_a, others[:, :, None], -np.inf).max(axis=1)  # [n, S]
        wb_new = ld / (counts + 1)  # [n, E] a new replica of b
        new_h = (peak[:, None] - wa)[:, :, None] + wb_new[:, None, :]  # [n, S, E]
        worst = np.maximum(new_h, (a_max + rise)[:, :, None])
        ok_b = ~hosted[ar, h, :experts] & (counts < topology.num_live)  # [n, E]
        valid = droppable[:, :, None] & ok_b[:, None, :]
        worst = np.where(valid, worst, np.inf).reshape(n, -1)
        pick = worst.argmin(axis=1)
        better = worst[ar, pick] < peak * (1 - 1e-9)
        active[act[~better]] = False
        sel = np.flatnonzero(better)
        i, b = np.unravel_index(pick[sel], (cap, experts))
        slots[act[sel], h[sel], i] = b
    return _compact(slots)


def local_search(slots: np.ndarray, weight: np.ndarray, topology: Topology, rounds: int, partners: int = 8,
                 target: np.ndarray | None = None) -> np.ndarray:
    """slots: [L, G, S]; weight: [L, E] load per replica; target: [L] stop a layer once its peak ≤ target.

    Each round, per layer: h = the most loaded GPU; try every swap of a shard on h with a shard or empty slot on
    one of the `partners` least loaded live GPUs (shards stay at most once per GPU); apply the swap that minimises
    max(new load of h, new load of the partner) if that is below h's load. A layer stops when no swap helps.
    The peak of a layer never rises.
    """
    slots = np.array(slots, dtype=np.int64)
    layers, gpus, cap = slots.shape
    experts = weight.shape[1]
    k = min(partners, topology.num_live - 1)
    if k < 1:
        return slots
    wpad = np.concatenate([weight, np.zeros((layers, 1))], axis=1)
    dead = ~topology.live
    idx = np.where(slots < 0, experts, slots)  # [L, G, S]; `experts` = empty
    w = np.take_along_axis(wpad, idx.reshape(layers, -1), axis=1).reshape(idx.shape)
    loads = w.sum(axis=-1)  # [L, G]
    # [L, E + 1, G]: which GPUs host a shard, one contiguous row per shard; row E (empty) stays False.
    hosted = _hosts(slots, experts, pad=True).transpose(0, 2, 1).copy()
    full = k >= topology.num_live - 1  # every other GPU is a partner: no selection needed
    active = np.ones(layers, dtype=bool)
    stop = np.full(layers, -np.inf) if target is None else target * (1 + 1e-12) + 1e-12
    rows = np.arange(layers)
    for _ in range(rounds):
        masked = np.where(dead, -np.inf, loads)
        h = masked.argmax(axis=1)
        peak = masked[rows, h]
        active &= peak > stop
        act = np.flatnonzero(active)
        if not len(act):
            break
        h, peak, n = h[act], peak[act], len(act)
        ar = np.arange(n)
        offer = np.where(dead, np.inf, loads[act])  # a failed GPU or h itself never takes a shard
        offer[ar, h] = np.inf
        a, wa = idx[act, h], w[act, h]  # [n, S]
        a_on = hosted[act[:, None], a]  # [n, S, G]
        if full:
            part = np.broadcast_to(np.arange(gpus), (n, gpus))
            b, wb, lg, a_on_g = idx[act], w[act], offer, a_on
        else:
            part = np.argpartition(offer, k - 1, axis=1)[:, :k]  # [n, k] least loaded other live GPUs
            b, wb = idx[act[:, None], part], w[act[:, None], part]  # [n, k, S]
            lg = np.take_along_axis(offer, part, axis=1)  # [n, k]
            a_on_g = np.take_along_axis(a_on, np.broadcast_to(part[:, None, :], (n, cap, k)), axis=2)
        b_on_h = hosted[act[:, None, None], b, h[:, None, None]]  # [n, k, S]
        delta = wa[:, :, None, None] - wb[:, None, :, :]  # [n, S, k, S] load leaving h
        worst = lg[:, None, :, None] + delta  # the partner's new load
        np.maximum(worst, peak[:, None, None, None] - delta, out=worst)
        invalid = a_on_g[..., None] | b_on_h[:, None]
        invalid |= (a == experts)[:, :, None, None]
        np.putmask(worst, invalid, np.inf)
        worst = worst.reshape(n, -1)
        pick = worst.argmin(axis=1)
        better = worst[ar, pick] < peak * (1 - 1e-9)
        active[act[~better]] = False
        sel = np.flatnonzero(better)
        if not len(sel):
            continue
        i, kk, j = np.unravel_index(pick[sel], (cap, part.shape[1], cap))
        layer, gh, gg = act[sel], h[sel], part[sel, kk]
        sa, sb = a[sel, i], b[sel, kk, j]
        wsa, wsb = wa[sel, i], wb[sel, kk, j]
        idx[layer, gh, i], idx[layer, gg, j] = sb, sa
        w[layer, gh, i], w[layer, gg, j] = wsb, wsa
        loads[layer, gh] += wsb - wsa
        loads[layer, gg] += wsa - wsb
        hosted[layer, sa, gh] = False
        hosted[layer, sa, gg] = True
        hosted[layer, sb, gg] = False
        hosted[layer, sb, gh] = True
        hosted[:, experts] = False
    return _compact(np.where(idx == experts, -1, idx))


def spread_over_nodes(slots: np.ndarray, weight: np.ndarray, topology: Topology) -> np.ndarray:
    """Per layer the better of two greedy bin-to-node assignments (_assign_nodes with and without the even-spread
    tie-break): more shards reaching min(replicas, nodes) nodes, then the lower node peak."""
    if topology.nodes == 1:
        return slots
    experts, nodes, per = weight.shape[1], topology.nodes, topology.gpus_per_node

    def quality(out: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hosts = _hosts(out, experts)  # [L, G, E]
        reach = hosts.reshape(len(out), nodes, per, experts).any(axis=2).sum(axis=1)
        short = (reach < np.minimum(hosts.sum(axis=1), nodes)).sum(axis=1)  # shards short of nodes
        node_peak = _loads(out, weight).reshape(len(out), nodes, per).sum(axis=2).max(axis=1)
        return short, node_peak

    a = _assign_nodes(slots, weight, topology, even=True)
    sa, pa = quality(a, weight)
    redo = np.flatnonzero(sa > 0)  # only layers where some shard is short of nodes try the other order
    if len(redo):
        b = _assign_nodes(slots[redo], weight[redo], topology, even=False)
        sb, pb = quality(b, weight[redo])
        use = (sb < sa[redo]) | ((sb == sa[redo]) & (pb < pa[redo]))
        a[redo[use]] = b[use]
    return a


def _assign_nodes(slots: np.ndarray, weight: np.ndarray, topology: Topology, even: bool) -> np.ndarray:
    """Permute each layer's GPU bins (balance unchanged): bins heaviest first, each to the node with a free live
    GPU where the fewest of its shards would land on a node they already occupy while they still lack nodes (a shard
    with r replicas should reach min(r, nodes) nodes), ties to the least loaded node."""
    layers, gpus, cap = slots.shape
    experts = weight.shape[1]
    nodes, per = topology.nodes, topology.gpus_per_node
    if nodes == 1:
        return slots
    live = topology.live
    idx = np.where(slots < 0, experts, slots)
    wpad = np.concatenate([weight, np.zeros((layers, 1))], axis=1)
    loads = np.take_along_axis(wpad, idx.reshape(layers, -1), axis=1).reshape(idx.shape).sum(axis=-1)
    live_ids = np.flatnonzero(live)
    order = live_ids[np.argsort(-loads[:, live_ids], axis=1, kind="stable")]  # [L, live] bins heaviest first
    # Each node's live GPUs in index order; a node takes bins into them one by one.
    node_gpus = np.full((nodes, per), -1, dtype=np.int64)
    room = np.zeros(nodes, dtype=np.int64)
    for g in live_ids:
        node_gpus[g // per, room[g // per]] = g
        room[g // per] += 1
    used = np.zeros((layers, nodes), dtype=np.int64)
    count = np.zeros((layers, nodes, experts + 1), dtype=np.int64)
    node_load = np.zeros((layers, nodes))
    scale = np.maximum(loads.sum(axis=1, keepdims=True), 1e-30) * 2  # node load / scale < 1: spreading dominates
    rows = np.arange(layers)
    # A shard with r replicas should reach min(r, nodes) nodes; a bin costs one for each of its shards that it would
    # put on a node already hosting it while the shard has not reached that many nodes yet.
    need = np.minimum(_hosts(slots, experts, pad=True).sum(axis=1), nodes)  # [L, E + 1]
    need[:, experts] = 0
    covered = np.zeros((layers, experts + 1), dtype=np.int64)
    out = np.full_like(slots, -1)
    for step in range(len(live_ids)):
        b = order[:, step]
        shards = idx[rows, b]  # [L, S]
        here = np.where((shards < experts)[..., None], count[rows[:, None], :, shards], 0)  # [L, S, nodes]
        short = np.take_along_axis(covered < need, shards, axis=1)  # [L, S]
        lost = ((here > 0) & short[..., None]).sum(axis=1)  # [L, nodes] spread lost
        # Lexicographic: spread lost, then (even) replicas already there (even spread of hot shards), then node load.
        score = lost * (cap * gpus + 1) + (here.sum(axis=1) if even else 0) + node_load / scale
        score = np.where(used < room, score, np.inf)
        n = score.argmin(axis=1)
        target = node_gpus[n, used[rows, n]]
        out[rows, target] = slots[rows, b]
        used[rows, n] += 1
        node_load[rows, n] += loads[rows, b]
        new_node = count[rows[:, None], n[:, None], shards] == 0  # [L, S]
        # A bin holds each shard once; only the empty column `experts` repeats, and nothing reads it.
        covered[rows[:, None], shards] += new_node
        count[rows[:, None], n[:, None], shards] += 1
    return out


def repair(slots: np.ndarray, counts: np.ndarray, weight: np.ndarray, topology: Topology) -> np.ndarray:
    """Bring a placement to the replica counts `counts: [L, E]` touching as little as possible: surplus replicas
    leave the most loaded GPUs hosting them, missing ones go greedily (heaviest first, least loaded GPU with room).
    slots: [L, G, S] with failed GPUs already emptied."""
    layers, gpus, cap = slots.shape
    experts = counts.shape[1]
    slots = np.array(slots, dtype=np.int64)
    idx = np.where(slots < 0, experts, slots)
    wpad = np.concatenate([weight, np.zeros((layers, 1))], axis=1)
    loads = np.take_along_axis(wpad, idx.reshape(layers, -1), axis=1).reshape(idx.shape).sum(axis=-1)
    have = _hosts(slots, experts).sum(axis=1)
    surplus = have - counts
    if (surplus > 0).any():
        layer, gpu, slot = np.nonzero(slots >= 0)
        shard = slots[layer, gpu, slot]
        # Within each (layer, shard), replicas on heavier GPUs first; drop the first `surplus` of them.
        order = np.lexsort((-loads[layer, gpu], shard, layer))
        layer, gpu, slot, shard = layer[order], gpu[order], slot[order], shard[order]
        group = layer * (experts + 1) + shard
        start = np.r_[0, np.flatnonzero(group[1:] != group[:-1]) + 1]
        rank = np.arange(len(group)) - np.repeat(start, np.diff(np.r_[start, len(group)]))
        drop = rank < surplus[layer, shard]
        slots[layer[drop], gpu[drop], slot[drop]] = -1
        slots = _compact(slots)
    missing = np.maximum(counts - _hosts(slots, experts).sum(axis=1), 0)  # [L, E]
    most = int(missing.sum(axis=1).max())
    if most == 0:
        return slots
    # Items to add, heaviest first, padded with -1.
    add = np.full((layers, most), -1, dtype=np.int64)
    key = np.where(missing > 0, -weight, np.inf)
    order = np.argsort(key, axis=1, kind="stable")
    for layer in np.flatnonzero(missing.sum(axis=1)):
        reps = np.repeat(order[layer], missing[layer, order[layer]])
        add[layer, :len(reps)] = reps
    return pack_greedy(add, weight, topology, initial=slots)


def match_gpus(slots: np.ndarray, current: np.ndarray, topology: Topology) -> np.ndarray:
    """Permute each layer's GPU bins of `slots` onto live GPUs to share as many shards with `current` as possible
    (greedy: bins with the largest overlap first, each to its best free GPU; balance unchanged).
    slots, current: [L, G, S]."""
    layers, gpus, _ = slots.shape
    experts = int(max(slots.max(), current.max())) + 1
    live_ids = np.flatnonzero(topology.live)
    cur = _hosts(current[:, live_ids], experts, pad=True).transpose(0, 2, 1)  # [L, E + 1, gpu]
    mine = np.where(slots[:, live_ids] < 0, experts, slots[:, live_ids])  # [L, bin, S]
    overlap = cur[np.arange(layers)[:, None, None], mine].sum(axis=2, dtype=np.int64)  # [L, bin, gpu]
    order = np.argsort(-overlap.max(axis=2), axis=1, kind="stable")  # [L, live] bins, most to keep first
    rows = np.arange(layers)
    taken = np.zeros((layers, len(live_ids)), dtype=bool)
    out = np.full_like(slots, -1)
    for step in range(len(live_ids)):
        b = order[:, step]
        to = np.where(taken, -1, overlap[rows, b]).argmax(axis=1)
        taken[rows, to] = True
        out[rows, live_ids[to]] = slots[rows, live_ids[b]]
    return out


def repack_extremes(slots: np.ndarray, weight: np.ndarray, topology: Topology, k: int) -> np.ndarray:
    """Ruin and recreate: empty each layer's k most and k least loaded live GPUs and pack their shards back onto
    them greedily (heaviest first, least loaded first). Moves at most 2k x slots_per_gpu shards per layer."""
    layers, gpus, cap = slots.shape
    experts = weight.shape[1]
    live_ids = np.flatnonzero(topology.live)
    k = min(k, len(live_ids) // 2)
    loads = _loads(slots, weight)[:, live_ids]
    order = live_ids[np.argsort(loads, axis=1, kind="stable")]
    chosen = np.concatenate([order[:, :k], order[:, -k:]], axis=1)  # [L, 2k]
    rows = np.arange(layers)[:, None]
    items = slots[rows, chosen].reshape(layers, -1)  # [L, 2k * S]
    key = np.where(items < 0, np.inf, -np.take_along_axis(np.concatenate([weight, np.zeros((layers, 1))], 1),
                                                          np.where(items < 0, experts, items), axis=1))
    items = np.take_along_axis(items, np.argsort(key, axis=1, kind="stable"), axis=1)
    emptied = slots.copy()
    emptied[rows, chosen] = -1
    open_gpus = np.zeros((layers, gpus), dtype=bool)
    open_gpus[rows, chosen] = True
    return _compact(pack_greedy(items, weight, topology, initial=emptied, open_gpus=open_gpus))


def _escape(slots: np.ndarray, weight: np.ndarray, topology: Topology, goal: np.ndarray, rounds: int,
            partners: int) -> np.ndarray:
    """Layers still above `goal` after the local search: repack their extreme GPUs, 1, 2, 4, ... at a time, keeping a
    repack only where it lowers the peak."""
    slots = slots.copy()
    k = 1
    while k <= topology.num_live // 2:
        need = np.flatnonzero(~_reached(slots, weight, topology, goal))
        if not len(need):
            break
        w = weight[need]
        trial = local_search(repack_extremes(slots[need], w, topology, k), w, topology, rounds=rounds,
                             partners=partners, target=goal[need])
        better = _peak(trial, w, topology) < _peak(slots[need], w, topology)
        slots[need[better]] = trial[better]
        k *= 2
    return slots


# ---- helpers -----------------------------------------------------------------------------------------------------


def _check_replicas(replicas: np.ndarray, layers: int, experts: int, topology: Topology) -> np.ndarray:
    counts = np.asarray(replicas)
    if counts.shape != (layers, experts) or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"replicas: expected integers [layers={layers}, experts={experts}], got "
                         f"{counts.dtype} {list(counts.shape)}")
    if (counts < 1).any() or (counts > topology.num_live).any():
        raise ValueError(f"replicas: each shard needs 1..{topology.num_live} (live GPUs) replicas")
    room = topology.num_live * topology.slots_per_gpu
    if (counts.sum(axis=1) > room).any():
        raise ValueError(f"replicas: a layer has more than {room} replicas (live GPUs x slots_per_gpu)")
    return counts.astype(np.int64)


def _fit_current(current: Placement, topology: Topology) -> np.ndarray:
    """current's slots on `topology`: GPUs matched by index, failed or missing GPUs and extra slots dropped."""
    layers = current.layers
    out = np.full((layers, topology.num_gpus, topology.slots_per_gpu), -1, dtype=np.int64)
    g = min(topology.num_gpus, current.topology.num_gpus)
    s = min(topology.slots_per_gpu, current.topology.slots_per_gpu)
    out[:, :g, :s] = current.slots[:, :g, :s]
    out[:, ~topology.live] = -1
    return _compact(out)


def _compact(slots: np.ndarray) -> np.ndarray:
    """Each GPU row sorted by expert id with empties last."""
    key = np.where(slots < 0, np.iinfo(np.int64).max, slots)
    return np.take_along_axis(slots, np.argsort(key, axis=-1, kind="stable"), axis=-1)


def _hosts(slots: np.ndarray, experts: int, pad: bool = False) -> np.ndarray:
    """slots: [L, G, S] -> [L, G, E] bool (with pad: [L, G, E + 1], last column False)."""
    layers, gpus, _ = slots.shape
    has = np.zeros((layers, gpus, experts + 1), dtype=bool)
    has[np.arange(layers)[:, None, None], np.arange(gpus)[None, :, None], np.where(slots < 0, experts, slots)] = True
    has[..., experts] = False
    return has if pad else has[..., :experts]


def _loads(slots: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """slots: [L, G, S], weight: [L, E] -> [L, G] GPU loads."""
    layers = slots.shape[0]
    wpad = np.concatenate([weight, np.zeros((layers, 1))], axis=1)
    idx = np.where(slots < 0, weight.shape[1], slots)
    return np.take_along_axis(wpad, idx.reshape(layers, -1), axis=1).reshape(idx.shape).sum(axis=-1)


def _reached(slots: np.ndarray, weight: np.ndarray, topology: Topology, goal: np.ndarray) -> np.ndarray:
    """[L] the layer's peak is at or under its goal (up to rounding)."""
    return _peak(slots, weight, topology) <= goal * (1 + 1e-12) + 1e-12


def _peak(slots: np.ndarray, weight: np.ndarray, topology: Topology) -> np.ndarray:
    """[L] the most loaded live GPU's load."""
    return _loads(slots, weight)[:, topology.live].max(axis=1)
