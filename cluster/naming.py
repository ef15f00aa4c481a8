"""Names of the actors expertmesh creates, so operators can find them (and kill them in drills). No Ray here, so
modules that only need a name (routers, drills, tests) need not import the actor modules.

Every actor of a mesh lives in that mesh's Ray namespace; the controller is `controller`. A mesh id (`mesh.id`,
default "default") names the mesh: `MeshNames.of(mesh_id)` gives its namespace, controller name and stored-key
prefix, so several meshes (models) share one Ray cluster. The default mesh keeps the names it always had: namespace
`expertmesh`, keys `expertmesh/<what>`; mesh "chat" gets namespace `expertmesh-chat` and keys
`expertmesh/chat/<what>`. Actor and controller names are the same in every mesh (Ray names are per namespace).

An expert actor is `expert-e{group}-r{replica}`: with the default grouping the group is the logical expert id and
the actor hosts that expert for every MoE layer, so `expert-e3-r0` is replica 0 of expert 3. A planned placement
(cluster/planner.py) runs one actor per GPU hosting that GPU's shards, `expert-g{gpu}-v{version}`; a new version
replaces it when its shard set changes. A stand-in the controller starts for lost actors when the survivors have no
room for them at their normal size (cluster/lost_restore.py) is `expert-s{serial}`; it goes when they come back.
`parse_expert_actor_name` reads both forms as (group, replica): (gpu, version) for the second.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

NAMESPACE = "expertmesh"  # the default mesh's namespace
CONTROLLER_NAME = "controller"  # the controller actor (cluster/controller.py), detached, in its mesh's namespace
DEFAULT_MESH_ID = "default"
MAX_MESH_ID_CHARS = 40
# The default mesh's keys are expertmesh/<what>, another mesh's expertmesh/<id>/<what>: an id equal to the first
# segment of one of the default mesh's keys could read them.
RESERVED_MESH_IDS = frozenset({"load", "routing-table", "controller", "transport-secret", "hf-token"})
_MESH_ID = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")  # a DNS label, lower case; used with fullmatch


def mesh_id_problem(mesh_id: object) -> str | None:
    """Why `mesh_id` is not a mesh id (a DNS-label-like string), or None when it is one."""
    if not isinstance(mesh_id, str):
        return f"must be a string, got {type(mesh_id).__name__}"
    if not mesh_id or len(mesh_id) > MAX_MESH_ID_CHARS or not _MESH_ID.fullmatch(mesh_id):
        return (f"must be 1-{MAX_MESH_ID_CHARS} lower-case letters, digits and '-', starting and ending with a "
                f"letter or digit (like a DNS label), got {mesh_id!r}")
    if mesh_id in RESERVED_MESH_IDS:
        return f"{mesh_id!r} is reserved (the default mesh's stored keys use it)"
    return None


@dataclass(frozen=True)
class MeshNames:
    """Everything a mesh keeps in Ray, named from its id."""

    mesh_id: str
    namespace: str  # the Ray namespace of its expert actors and controller
    controller: str  # the controller actor's name (in `namespace`)
    key_prefix: str  # of its keys in Ray's GCS key-value store (cluster/mesh_store.py)
    app_name: str  # its Ray Serve application

    @classmethod
    def of(cls, mesh_id: str = DEFAULT_MESH_ID) -> MeshNames:
        """ValueError when `mesh_id` is not a mesh id."""
        problem = mesh_id_problem(mesh_id)
        if problem is not None:
            raise ValueError(f"mesh id {problem}")
        if mesh_id == DEFAULT_MESH_ID:
            return cls(mesh_id, NAMESPACE, CONTROLLER_NAME, "expertmesh/", "expertmesh")
        return cls(mesh_id, f"{NAMESPACE}-{mesh_id}", CONTROLLER_NAME, f"expertmesh/{mesh_id}/",
                   f"expertmesh-{mesh_id}")

    def is_router_replica(self, actor_name: str) -> bool:
        """Whether a Ray actor name is one of this mesh's router replicas: Serve names them
        `SERVE_REPLICA::<app>#router#<id>`, and the app is per mesh (a prefix test on "expertmesh" alone would also
        match mesh "chat"'s `expertmesh-chat`)."""
        return actor_name.startswith(f"SERVE_REPLICA::{self.app_name}#router#")

    def key(self, what: str) -> bytes:
        """The stored key of `what` ("routing-table", "controller", ...) for this mesh."""
        if not what or what.startswith("/"):
            raise ValueError(f"a stored key's name is a relative path, got {what!r}")
        return (self.key_prefix + what).encode()


DEFAULT_MESH = MeshNames.of(DEFAULT_MESH_ID)


def mesh_id_of_app(app_name: str) -> str | None:
    """The mesh whose Serve application `app_name` is ('expertmesh' -> 'default', 'expertmesh-chat' -> 'chat'), or
    None for any other application (`expertmesh front --all-meshes` finds the meshes on a cluster this way)."""
    if app_name == DEFAULT_MESH.app_name:
        return DEFAULT_MESH_ID
    prefix = f"{NAMESPACE}-"
    if not app_name.startswith(prefix):
        return None
    mesh_id = app_name.removeprefix(prefix)
    # "expertmesh-default" is nobody's app (the default mesh's is "expertmesh"); not a mesh id: someone else's app
    if mesh_id == DEFAULT_MESH_ID or mesh_id_problem(mesh_id) is not None:
        return None
    return mesh_id


def mesh_ids_of_apps(app_names: Iterable[str]) -> list[str]:
    """The meshes among Serve application names, the default mesh first, then by id (other apps left out)."""
    found = {m for m in map(mesh_id_of_app, app_names) if m is not None}
    return sorted(found, key=lambda m: (m != DEFAULT_MESH_ID, m))
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
