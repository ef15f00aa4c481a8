"""Bookkeeping of displaced actors: lost actors the survivors had no room for at their normal share, and the
stand-ins that host their shards meanwhile (cluster/lost_restore.py plans both). Pure; no Ray.

The controller keeps `displaced` (persisted, cluster/controller_record.py): lost actor -> {"slot": its normal
ActorSlot fields, "shards": [[layer, expert], ...], "by": the stand-in hosting its shards, or None while they run on
their other replicas}. These functions say what a stand-in re-plan and a move back change in it and in the
placement; the controller applies the placement live (apply_placement) and then commits the bookkeeping.

    target = stand_in_placement(actor_shards, drained, plan)
    records = displace(displaced, plan, slots, actor_shards)     # before the remap forgets the lost actors' slots
    groups = return_groups(displaced)                           # -> lost_restore.plan_return
    move = move_back(back, actor_shards, drained, displaced)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass

from .actor_slots import ActorSlot
from .lost_restore import LostActor, RestorePlan
from .routing_table import Shard


def stand_in_placement(actor_shards: Mapping[str, Sequence[Shard]], drained: Collection[str],
                       plan: RestorePlan) -> dict[str, list]:
    """The placement while `plan`'s displaced actors are away: without them (and drained ones), with its stand-ins."""
    displaced = set(plan.displaced)
    target: dict[str, list] = {n: list(s) for n, s in actor_shards.items() if n not in drained and n not in displaced}
    target.update({n: [list(x) for x in s.shards] for n, s in plan.stand_ins.items()})
    return target


def displace(displaced: dict[str, dict], plan: RestorePlan, slots: Mapping[str, ActorSlot],
             actor_shards: Mapping[str, Sequence[Shard]]) -> dict[str, dict]:
    """The records `plan` adds to `displaced` (returned, not yet added: the caller adds them, and drops them again
    if the remap fails). A displaced stand-in hands its own displaced actors on to whatever replaces it now: that
    update is made in `displaced` at once."""
    records = {}
    for name in plan.displaced:
        by = next((n for n, s in plan.stand_ins.items() if name in s.replaces), None)
        hosted = [orig for orig, d in displaced.items() if d["by"] == name]
        for orig in hosted:
            displaced[orig]["by"] = by
        if not hosted:
            records[name] = {"slot": asdict(slots[name]), "shards": [list(x) for x in actor_shards[name]], "by": by}
    return records


def return_groups(displaced: Mapping[str, dict]) -> dict[str, list[LostActor]]:
    """Displaced actors grouped by who hosts them now (a stand-in, or themselves when deferred): a stand-in retires
    only when all it hosts go back at once (lost_restore.plan_return)."""
    groups: dict[str, list[LostActor]] = {}
    for name, d in sorted(displaced.items()):
        groups.setdefault(d["by"] or name, []).append(LostActor(ActorSlot(**d["slot"]), tuple(map(tuple, d["shards"]))))
    return groups


@dataclass(frozen=True)
class MoveBack:
    returning: dict[str, ActorSlot]  # displaced actor -> its normal slot on a node with room now
    retiring: list[str]  # stand-ins that host nothing once those are back
    placement: dict[str, list]  # the placement to apply


def move_back(back: Mapping[str, Mapping[str, ActorSlot]], actor_shards: Mapping[str, Sequence[Shard]],
              drained: Collection[str], displaced: Mapping[str, dict]) -> MoveBack:
    """back: lost_restore.plan_return's answer (group -> {actor: slot})."""
    returning = {name: slot for slots in back.values() for name, slot in slots.items()}
    retiring = [g for g in back if g in actor_shards and g not in returning]
    placement: dict[str, list] = {n: list(s) for n, s in actor_shards.items() if n not in drained and n not in retiring}
    placement.update({n: displaced[n]["shards"] for n in returning})
    return MoveBack(returning, retiring, placement)


def resource_bundles(gpus: int, restore_request: Sequence[dict]) -> list[dict]:
    """One request to Ray's autoscaler for both needs (each request replaces the last): the elastic loop's one-GPU
    bundles and the normal shape of the displaced actors."""
    return [{"GPU": 1}] * gpus + list(restore_request)
