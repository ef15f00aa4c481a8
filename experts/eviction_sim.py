"""Replaying a recorded routing trace (ops/bench/routing_trace.py) through the expert tier's eviction orders
(experts/eviction.py) and prefetch decision, without weights or actors: which shards every actor would have had to
load, per policy and residency. Pure (no torch, no Ray); tested in tests/unit/test_eviction_sim.py.

The model of the tier is the store's (experts/tier_store.py): the per-expert layout (actor e hosts expert e of
every MoE layer), a budget of `capacity` shards per actor, a call's shard pinned while it computes, a demand miss
loads over nothing but unpinned shards. Decode: `batch` sequences step together, token t of each at step t; at each
MoE layer an actor is called when any sequence routes to its expert.

Prefetch ("gate"): while layer l computes, the next layer's gate applied to layer l's input predicts its experts
(the trace's `next_pred`, top-4 with probabilities per token); an expert is prefetched when some token's predicted
probability for it reaches `min_confidence` (0: every top-k prediction, today's behaviour). The step's last layer
predicts the next step's first from history (what it used last step). A prefetch is loaded after the current call
releases its shard (as the store does when pinned shards fill the budget) and evicts by the same order, never the
shard of the layer computing now.

Counted per run: demand loads (each one a stall), prefetch loads and how many a call then used, evictions of a shard
that a later layer of the same step needed ("needed-evictions"), and shards moved in all.
"""

from __future__ import annotations

from collections.abc import Iterable

from .eviction import make_eviction_order

Shard = tuple[int, int]


class SimTier:
    """One actor's device tier in shards: capacity, resident set, an eviction order, counters."""

    def __init__(self, policy: str, capacity: int, layers: list[int]):
        assert capacity >= 1, capacity
        self.capacity = capacity
        self.order = make_eviction_order(policy, layers=layers, capacity=capacity)
        self.resident: set[Shard] = set()
        self.prefetched: set[Shard] = set()
        self.now = 0.0
        self.demand_loads = self.hits = self.prefetch_loads = self.prefetch_used = self.evicted = 0

    def _victims(self, pinned: Iterable[Shard]) -> list[Shard]:
        """The shards that would leave so one more fits (fewer when pinned ones are all that is left)."""
        pinned = set(pinned)
        order = self.order.order([s for s in self.resident if s not in pinned], self.now)
        return order[:max(0, len(self.resident) - self.capacity + 1)]

    def _room(self, pinned: Iterable[Shard]) -> list[Shard]:
        out = []
        for victim in self._victims(pinned):
            self.resident.discard(victim)
            self.prefetched.discard(victim)
            self.order.on_evict(victim)
            self.evicted += 1
            out.append(victim)
        return out

    def use(self, shard: Shard) -> list[Shard]:
        """A call computes with `shard`: -> the shards its load evicted."""
        self.now += 1.0
        self.order.on_use([shard], self.now)
        if shard in self.prefetched:
            self.prefetch_used += 1
            self.prefetched.discard(shard)
        if shard in self.resident:
            self.hits += 1
            return []
        self.demand_loads += 1
        evicted = self._room(pinned=())
        self.resident.add(shard)
        self.order.on_admit(shard, self.now)
        return evicted

    def prefetch(self, shard: Shard, computing: Iterable[Shard] = ()) -> list[Shard]:
        """Load `shard` ahead; `computing`: the shard a call computes with now (pinned). When it alone fills the
        budget the store waits for its release and then loads, so that case evicts it; so does the case where the
        order's first victim is that shard (the store defers the hint until the release)."""
        if shard in self.resident:
            return []
        computing = list(computing)
        if computing and len(self.resident) >= self.capacity:
            order = self.order.order(sorted(self.resident), self.now)
            if order and order[0] in computing:
                computing = []  # deferred: evicts the released shard, as the order wants
        evicted = self._room(pinned=computing)
        if len(self.resident) >= self.capacity:
            evicted += self._room(pinned=())
        self.prefetch_loads += 1
        self.resident.add(shard)
        self.prefetched.add(shard)
        self.order.on_admit(shard, self.now)
        return evicted


def simulate(trace: dict, policy: str, share: float, batch: int, prefetch: str = "off",
             min_confidence: float = 0.0, start: int = 0) -> dict:
    """Decode of sequences [start, start + batch) of the trace at `share` residency (of each actor's shards) with
    the eviction order `policy` and prefetch "off" or "gate". -> counters summed over actors (see the docstring)."""
    assert prefetch in ("off", "gate"), prefetch
    layers = list(trace["layers"])
    seqs = trace["sequences"][start:start + batch]
    assert seqs, "no sequences in range"
    capacity = max(1, round(share * len(layers)))
    tiers = {e: SimTier(policy, capacity, layers) for e in range(trace["num_experts"])}
    for e, tier in tiers.items():  # preload in (layer, expert) order, as TierStore.preload
        for layer in layers[:capacity]:
            tier.resident.add((layer, e))
            tier.order.on_admit((layer, e), 0.0)
    steps = min(len(s["tokens"]) for s in seqs)
    needed_evictions = calls = 0
    last_used: dict[int, set[int]] = {}
    for t in range(steps):
        used = {layer: {e for s in seqs for e in s["tokens"][t]["experts"][i] if e >= 0}
                for i, layer in enumerate(layers)}
        for i, layer in enumerate(layers):
            for e in sorted(used[layer]):
                calls += 1
                for victim in tiers[e].use((layer, e)):
                    later = victim[0] in layers[i + 1:] and e in used[victim[0]]
                    needed_evictions += int(later)
            if prefetch == "gate":
                nxt = layers[(i + 1) % len(layers)]
                guess = (_confident(seqs, t, i, min_confidence, trace["top_k"]) if i + 1 < len(layers)
                         else last_used.get(nxt, set()))
                for e in sorted(guess):  # the hint rides with this layer's call: its shard is pinned
                    computing = [(layer, e)] if e in used[layer] else []
                    for victim in tiers[e].prefetch((nxt, e), computing):
                        needed_evictions += int(victim[0] in layers[i + 1:] and e in used[victim[0]])
            last_used[layer] = used[layer]
    totals = {k: sum(getattr(tier, k) for tier in tiers.values())
              for k in ("demand_loads", "hits", "prefetch_loads", "prefetch_used", "evicted")}
    return totals | {"policy": policy, "share": share, "batch": batch, "prefetch": prefetch,
                     "min_confidence": min_confidence, "capacity_shards": capacity, "steps": steps, "calls": calls,
                     "needed_evictions": needed_evictions,
                     "hit_rate": round(totals["hits"] / calls, 4) if calls else None,
                     "shards_moved": totals["demand_loads"] + totals["prefetch_loads"],
                     "prefetch_precision": (round(totals["prefetch_used"] / totals["prefetch_loads"], 4)
                                            if totals["prefetch_loads"] else None)}


def _confident(seqs: list[dict], t: int, i: int, min_confidence: float, top_k: int) -> set[int]:
    """Experts of layer i+1 predicted at step t: each token's top-k from the gate, kept when some token gives the
    expert at least min_confidence."""
    best: dict[int, float] = {}
    for s in seqs:
        for e, p in s["tokens"][t]["next_pred"][i][:top_k]:
            best[e] = max(best.get(e, 0.0), p)
    return {e for e, p in best.items() if p >= min_confidence}


def compare_policies(trace: dict, policies: Iterable[str], shares: Iterable[float], batches: Iterable[int],
                     prefetch: Iterable[str] = ("off", "gate")) -> list[dict]:
    """Every (policy, share, batch, prefetch) combination, in that nesting order."""
    return [simulate(trace, p, s, b, m) for p in policies for s in shares for b in batches for m in prefetch]
