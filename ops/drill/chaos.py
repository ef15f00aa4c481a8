"""What one tick of a chaos drill kills: a share of the live expert actors, the controller, a worker node -- together.

Pure (no Ray): run.py hands in what the last poll saw and the drill's seeded random generator, and carries the
plan out. Each part of a tick becomes its own KillRecord, so report.py scores every kill the way it scores the
single-mode drills (detection and restore per actor, controller back, ...).

The schedule, chosen so that every fault meets the others at least once:
- tick 0: a worker node that hosts expert actors, the controller, and a share of the actors on the *other* nodes
  (a node's own actors die with it: naming them again would count one death twice);
- every tick: `fraction` of the live expert actors (at least one);
- every `controller_every`-th tick: the controller again (the serve process recreates it between ticks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChaosTick:
    """The kills of one tick. `node` is a node id (None: no node this tick)."""

    actors: list[str] = field(default_factory=list)
    controller: bool = False
    node: str | None = None


def plan_chaos_tick(index: int, live_actors: dict[str, str], worker_nodes: list[str], removed_nodes: set[str],
                    fraction: float, rng: random.Random, controller_every: int = 2) -> ChaosTick:
    """Tick `index`'s kills.

    live_actors:   expert actor name -> node id, as the last poll saw them serving
    worker_nodes:  the cluster's worker node ids (the head is never removed: it holds the GCS)
    removed_nodes: nodes an earlier tick removed
    fraction:      share of the live expert actors killed each tick, in (0, 1]
    """
    assert 0 < fraction <= 1, fraction
    assert controller_every >= 1, controller_every
    node = None
    if index == 0:
        hosting = sorted({n for n in live_actors.values() if n in worker_nodes and n not in removed_nodes})
        if hosting:
            node = rng.choice(hosting)
    survivors = sorted(a for a, n in live_actors.items() if n != node)
    count = min(len(survivors), max(1, round(fraction * len(live_actors)))) if survivors else 0
    actors = sorted(rng.sample(survivors, count)) if count else []
    return ChaosTick(actors=actors, controller=index % controller_every == 0, node=node)
