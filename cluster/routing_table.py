"""Routing table: which expert actors serve each shard, versioned by an epoch. Pure; no Ray.

A shard is one (layer, expert) pair. When a shard has several replicas, its tokens of one step are split into
contiguous chunks across them, so replicas share load and every actor still gets at most one call per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Shard = tuple[int, int]


@dataclass(frozen=True)
class RoutingTable:
    replicas: dict[Shard, tuple[str, ...]]  # shard -> actor names, in preference order
    epoch: int = 0
    actors: dict[str, tuple[Shard, ...]] = field(default_factory=dict)  # actor -> shards it hosts

    @classmethod
    def from_actor_shards(cls, actor_shards: dict[str, list[Shard]], epoch: int = 0) -> RoutingTable:
        replicas: dict[Shard, list[str]] = {}
        for actor, shards in actor_shards.items():
            for shard in shards:
                replicas.setdefault(shard, []).append(actor)
        return cls(
            replicas={s: tuple(a) for s, a in replicas.items()},
            epoch=epoch,
            actors={a: tuple(s) for a, s in actor_shards.items()},
        )

    def split(self, shard: Shard, num_tokens: int) -> list[tuple[str, int, int]]:
        """[(actor, start, end)] covering range(num_tokens) in contiguous, near-equal chunks, one per replica."""
        actors = self.replicas.get(shard)
        if not actors:
            raise KeyError(f"no replica serves shard (layer={shard[0]}, expert={shard[1]})")
        return split_tokens(actors, num_tokens)


def split_tokens(actors: tuple[str, ...] | list[str], num_tokens: int) -> list[tuple[str, int, int]]:
    """[(actor, start, end)] covering range(num_tokens) in contiguous, near-equal chunks, at most one per actor."""
    assert actors, "no actor to split tokens over"
    used = list(actors)[: max(1, min(len(actors), num_tokens))]
    bounds = [round(i * num_tokens / len(used)) for i in range(len(used) + 1)]
    return [(a, bounds[i], bounds[i + 1]) for i, a in enumerate(used) if bounds[i + 1] > bounds[i]]
