"""Which shards still have a live replica: the guard on destructive Admin calls and the health verdict. Pure; no Ray.

A replica is live when it is not drained and not down (lost, being restored, or known dead to the router). A shard
(one (layer, expert) pair) with no live replica cannot be computed: with the `wait` policy its tokens are held until
a replica comes back, then fail UNAVAILABLE; with `degrade` they go to the token's next-best expert with a live
replica, so the model still answers unless a whole MoE layer has no live expert at all.

    orphaned_by_removal(placement, down, "expert-e3-r0")  -> shards that draining/killing it would leave with none
    unserved_shards(shards, replicas, down)               -> shards with no live replica now
    health_verdict(shards, replicas, down, policy)        -> can the service answer every request now?
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .routing_table import Shard


def orphaned_by_removal(placement: Mapping[str, Sequence[Shard]], down: Collection[str], removing: str) -> list[Shard]:
    """Shards of `removing` that no other live replica serves: taking `removing` out (drain or kill) would leave
    them with no live replica. Sorted. `removing` itself counts as gone whether or not it is up now (draining an
    actor that is being restored still takes its last hope of a replica away).

    placement: actor -> the shards it hosts (every actor the controller runs, drained ones included);
    down: actors that are not live now (drained, lost, restoring)."""
    assert removing in placement, f"{removing!r} is not in the placement"
    live_elsewhere: set[Shard] = set()
    for actor, shards in placement.items():
        if actor != removing and actor not in down:
            live_elsewhere.update(tuple(s) for s in shards)
    return sorted({tuple(s) for s in placement[removing]} - live_elsewhere)


def unserved_shards(shards: Iterable[Shard], replicas: Mapping[Shard, Sequence[str]],
                    down: Collection[str]) -> list[Shard]:
    """Shards (of `shards`, the model's every (layer, expert)) none of whose replicas is live. Sorted.

    replicas: the routing table (shard -> actors); a shard missing from it (every replica drained) has none."""
    return sorted(s for s in set(map(tuple, shards)) if not any(a not in down for a in replicas.get(s, ())))


@dataclass(frozen=True)
class HealthVerdict:
    serving: bool
    unserved: tuple[Shard, ...]  # shards with no live replica (may be non-empty while serving, under degrade)
    reason: str  # one line for logs and status: why not serving, or which shards run degraded


def health_verdict(shards: Iterable[Shard], replicas: Mapping[Shard, Sequence[str]], down: Collection[str],
                   policy: str) -> HealthVerdict:
    """SERVING or not, from the routing table and which actors are down.

    policy "wait": not serving while any shard has no live replica (its requests wait, then fail UNAVAILABLE).
    policy "degrade": serving while every MoE layer keeps at least one expert with a live replica (tokens move to the
    next-best expert); a layer with none left cannot route its tokens anywhere."""
    assert policy in ("wait", "degrade"), f"unknown no-replica policy {policy!r}"
    shards = sorted(set(map(tuple, shards)))
    unserved = unserved_shards(shards, replicas, down)
    if not unserved:
        return HealthVerdict(True, (), "every shard has a live replica")
    named = describe_shards(unserved)
    if policy == "wait":
        return HealthVerdict(False, tuple(unserved), f"no live replica of {named}")
    missing = set(unserved)
    dead_layers = sorted({layer for layer, _ in shards
                          if all((layer, e) in missing for lay, e in shards if lay == layer)})
    if dead_layers:
        return HealthVerdict(False, tuple(unserved), f"no live expert at all in layer(s) {dead_layers}")
    return HealthVerdict(True, tuple(unserved), f"degraded: no live replica of {named}")


def describe_shards(shards: Iterable[Shard]) -> str:
    """'(layer 0, expert 3), (layer 1, expert 3)' for messages."""
    return ", ".join(f"(layer {layer}, expert {expert})" for layer, expert in shards)
