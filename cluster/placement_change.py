"""What a live remap changes: which actors a new placement adds and which it retires. Pure; no Ray.

Actors load their weights once, so an actor that stays must keep its shards; a new actor needs a slot to start in.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from .routing_table import Shard


@dataclass(frozen=True)
class PlacementChange:
    added: list[str]  # in the target's order
    retired: list[str]  # sorted


def placement_change(current: Mapping[str, Sequence[Shard]], target: Mapping[str, Sequence[Shard]],
                     slots: Collection[str]) -> PlacementChange:
    """current: the running placement (drained actors left out); target: the new one, shards as tuples; slots: the
    actors a slot was given for. ValueError, naming the argument, when an actor would change shards or a new one
    has no slot."""
    changed = sorted(n for n in target if n in current and sorted(map(tuple, current[n])) != sorted(target[n]))
    if changed:
        raise ValueError(f"actor_shards: actors {changed} would change shards; give them new names")
    added = [n for n in target if n not in current]
    missing = [n for n in added if n not in slots]
    if missing:
        raise ValueError(f"slots: no slot for new actors {missing}")
    return PlacementChange(added, sorted(n for n in current if n not in target))
