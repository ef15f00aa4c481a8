"""Names of the actors expertmesh creates, so operators can find them (and kill them in drills). No Ray here, so
modules that only need a name (routers, drills, tests) need not import the actor modules.

Every actor lives in the Ray namespace `expertmesh`; the controller is `controller`. An expert actor is
`expert-e{group}-r{replica}`: with the default grouping the group is the logical expert id and the actor hosts that
expert for every MoE layer, so `expert-e3-r0` is replica 0 of expert 3. A planned placement (cluster/planner.py)
runs one actor per GPU hosting that GPU's shards, `expert-g{gpu}-v{version}`; a new version replaces it when its
shard set changes. A stand-in the controller starts for lost actors when the survivors have no room for them at
their normal size (cluster/lost_restore.py) is `expert-s{serial}`; it goes when they come back.
`parse_expert_actor_name` reads both forms as (group, replica): (gpu, version) for the second.
"""

from __future__ import annotations

import re

NAMESPACE = "expertmesh"
CONTROLLER_NAME = "controller"  # the controller actor (cluster/controller.py), detached, in NAMESPACE
_EXPERT_ACTOR = re.compile(r"expert-e([0-9]+)-r([0-9]+)")  # ASCII digits only; used with fullmatch
_GPU_ACTOR = re.compile(r"expert-g([0-9]+)-v([0-9]+)")
_STAND_IN_ACTOR = re.compile(r"expert-s([0-9]+)")


def expert_actor_name(group: int, replica: int) -> str:
    return f"expert-e{group}-r{replica}"


def gpu_actor_name(gpu: int, version: int) -> str:
    """The actor hosting GPU `gpu`'s shards of a planned placement, `version`-th of its shard sets."""
    return f"expert-g{gpu}-v{version}"


def stand_in_actor_name(serial: int) -> str:
    """A stand-in for lost actors (smaller share or merged shards) until they come back at their normal size."""
    return f"expert-s{serial}"


def parse_gpu_actor_name(name: str) -> tuple[int, int] | None:
    """'expert-g5-v2' -> (5, 2); None for any other name."""
    match = _GPU_ACTOR.fullmatch(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_expert_actor_name(name: str) -> bool:
    """True for an expert actor of any form ('expert-e3-r1', 'expert-g5-v2', 'expert-s0'), False for any other."""
    return bool(_EXPERT_ACTOR.fullmatch(name) or _GPU_ACTOR.fullmatch(name) or _STAND_IN_ACTOR.fullmatch(name))


def parse_expert_actor_name(name: str) -> tuple[int, int]:
    """'expert-e3-r1' -> (3, 1); 'expert-g5-v2' -> (5, 2); ValueError for anything else."""
    match = _EXPERT_ACTOR.fullmatch(name) or _GPU_ACTOR.fullmatch(name)
    if not match:
        raise ValueError(f"not an expert actor name: {name!r} (expected expert-e<group>-r<replica>)")
    return int(match.group(1)), int(match.group(2))
