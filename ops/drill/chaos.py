"""What one tick of a chaos drill kills: a share of the live expert actors, the controller, a worker node -- together.

Pure (no Ray): run.py hands in what the last poll saw and the drill's seeded random generator, and carries the
plan out. Each part of a tick becomes its own KillRecord, so report.py scores every kill the way it scores the
single-mode drills (detection and restore per actor, controller back, ...).

The schedule, chosen so that every fault meets the others at least once:
- tick 0: a worker node that hosts expert actors, the controller, and a share of the actors on the *other* nodes
  (a node's own actors die with it: naming them again would count one death twice);
- every tick: `fraction` of the live expert actors (at least one);
- every `controller_every`-th tick: the controller again (the serve process recreates it between ticks).

A disruption budget, as a PodDisruptionBudget or a chaos tool's max-unavailable gives one: a tick never takes the
last live replica of any (layer, expert) shard (`shards`, from the cluster state). The chaos drill measures failover,
and a shard with no live replica has nothing to fail over to: its tokens wait for a restore (the no-spare node drill
measures that on its own). Without the budget a tick that happened to take both replicas of one expert made the CI
drill's result a race between the restore and the request timeout on a loaded 2-core machine.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChaosTick:
    """The kills of one tick. `node` is a node id (None: no node this tick)."""

    actors: list[str] = field(default_factory=list)
    controller: bool = False
    node: str | None = None


def plan_chaos_tick(index: int, live_actors: dict[str, str], worker_nodes: list[str], removed_nodes: set[str],
                    fraction: float, rng: random.Random, controller_every: int = 2,
                    shards: Iterable[Iterable[str]] | None = None) -> ChaosTick:
    """Tick `index`'s kills.

    live_actors:   expert actor name -> node id, as the last poll saw them serving
    worker_nodes:  the cluster's worker node ids (the head is never removed: it holds the GCS)
    removed_nodes: nodes an earlier tick removed
    fraction:      share of the live expert actors killed each tick, in (0, 1]
    shards:        the actors holding each (layer, expert) shard; None: no disruption budget
    """
    assert 0 < fraction <= 1, fraction
    assert controller_every >= 1, controller_every
    budget = _Budget(live_actors, shards)
    node = None
    if index == 0:
        hosting = sorted({n for n in live_actors.values() if n in worker_nodes and n not in removed_nodes})
        hosting = [n for n in hosting if budget.allows([a for a, m in live_actors.items() if m == n])]
        if hosting:
            node = rng.choice(hosting)
            budget.take([a for a, m in live_actors.items() if m == node])
    survivors = sorted(a for a, n in live_actors.items() if n != node)
    count = min(len(survivors), max(1, round(fraction * len(live_actors)))) if survivors else 0
    return ChaosTick(actors=pick_within_budget(survivors, count, budget, rng),
                     controller=index % controller_every == 0, node=node)


class _Budget:
    """Live replicas left per shard as a tick's kills are chosen."""

    def __init__(self, live_actors: dict[str, str] | Iterable[str], shards: Iterable[Iterable[str]] | None):
        live = set(live_actors)
        self.shards = None if shards is None else [set(s) & live for s in shards]

    def allows(self, actors: Iterable[str]) -> bool:
        gone = set(actors)
        return self.shards is None or all(not s or s - gone for s in self.shards)

    def take(self, actors: Iterable[str]) -> None:
        if self.shards is not None:
            gone = set(actors)
            self.shards = [s - gone for s in self.shards]


def pick_within_budget(candidates: list[str], count: int, budget: _Budget | None, rng: random.Random) -> list[str]:
    """Up to `count` of `candidates` at random, skipping any whose death would leave a shard with no live replica."""
    order = rng.sample(candidates, len(candidates))
    picked: list[str] = []
    for actor in order:
        if len(picked) == count:
            break
        if budget is None or budget.allows([actor]):
            picked.append(actor)
            if budget is not None:
                budget.take([actor])
    return sorted(picked)

