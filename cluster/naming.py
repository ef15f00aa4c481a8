"""Names of the actors expertmesh creates, so operators can find them (and kill them in drills).

Every actor lives in the Ray namespace `expertmesh`. An expert actor is `expert-e{group}-r{replica}`: with the
default grouping the group is the logical expert id and the actor hosts that expert for every MoE layer, so
`expert-e3-r0` is replica 0 of expert 3.
"""

from __future__ import annotations

import re

NAMESPACE = "expertmesh"
_EXPERT_ACTOR = re.compile(r"expert-e([0-9]+)-r([0-9]+)")  # ASCII digits only; used with fullmatch


def expert_actor_name(group: int, replica: int) -> str:
    return f"expert-e{group}-r{replica}"


def parse_expert_actor_name(name: str) -> tuple[int, int]:
    """'expert-e3-r1' -> (3, 1); ValueError for anything else."""
    match = _EXPERT_ACTOR.fullmatch(name)
    if not match:
        raise ValueError(f"not an expert actor name: {name!r} (expected expert-e<group>-r<replica>)")
    return int(match.group(1)), int(match.group(2))
