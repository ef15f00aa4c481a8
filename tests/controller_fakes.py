"""A fake `ops` for the controller's flows (cluster/restore_flow.py, cluster/remap_flow.py, cluster/control_pass.py):
it records what they would do to the world. Used by test_controller_flows.py and test_controller_claims.py."""

from __future__ import annotations

import asyncio

from expertmesh.cluster.activity_log import ActivityLog
from expertmesh.cluster.actor_slots import ActorSlot
from expertmesh.cluster.controller_config import ControllerConfig
from expertmesh.cluster.lost_restore import NodeRoom
from expertmesh.cluster.pool_spec import PoolSpec
from expertmesh.cluster.remap_flow import Remapper
from expertmesh.cluster.replica_registry import SILENT, ReplicaRegistry
from expertmesh.cluster.restore_flow import RestoreFlow
from expertmesh.cluster.router_reports import RouterReports


class FakeOps:
    """Actors as names; `alive` answers probes; `broken` names fail to become ready."""

    def __init__(self, alive: set[str], rooms: list[NodeRoom]):
        self.alive = set(alive)
        self.broken: set[str] = set()
        self.stale_names: set[str] = set()  # names a dead node's actor still holds (release_stale_name frees them)
        self.silent: set[str] = set()  # listed and alive but not answering probes in time (busy or hung)
        self.room_list = rooms
        self.log: list[tuple] = []
        self.generation: dict[str, int] = {}
        self.holders: dict[str, str] = {}  # name -> the node Ray runs its live holder on (actor_node), if a test says
        self.unplaced: set[str] = set()  # started but on no node (Ray's queue): never ready while named here

    def spawn(self, slot: ActorSlot, spec: PoolSpec, generation: int, soft: bool = True) -> str:
        assert slot.name in spec.actor_shards, "an actor starts hosting shards of the spec it is given"
        self.log.append(("spawn", slot.name, slot.node_id, generation, soft))
        self.generation[slot.name] = generation
        return slot.name

    async def ready(self, handle: str, timeout_s: float) -> dict:
        while handle in self.unplaced:
            await asyncio.sleep(0.01)
        if handle in self.broken:
            raise TimeoutError(f"{handle} did not warm up")
        self.alive.add(handle)
        return {"generation": self.generation[handle], "node_id": "new-" + handle}

    def kill(self, handle: str) -> None:
        self.log.append(("kill", handle))
        self.alive.discard(handle)
        self.unplaced.discard(handle)  # a queued actor killed leaves Ray's queue

    def kill_named(self, name: str) -> bool:
        self.log.append(("kill", name))
        present = name in self.alive
        self.alive.discard(name)
        return present

    async def probe(self, name: str, timeout_s: float) -> dict | str | None:
        if name in self.silent and name in self.alive:
            return SILENT
        return {"generation": 1, "node_id": "a"} if name in self.alive else None

    def release_stale_name(self, name: str) -> bool:
        """Ray's side: kill a holder of `name` on a dead node. The fake holds no stale names unless a test says."""
        self.log.append(("release_stale_name", name))
        return name in self.stale_names and not self.stale_names.discard(name)

    def actor_node(self, name: str) -> str | None:
        self.log.append(("actor_node", name))
        return self.holders.get(name) if name in self.alive else None

    def placed(self, name: str) -> bool | None:
        return name not in self.unplaced if name in self.generation else None

    def rooms(self) -> list[NodeRoom]:
        return self.room_list

    def request_resources(self, gpus: int | None = None) -> None:
        self.log.append(("request",))

    def persist(self) -> None:
        self.log.append(("persist",))

    def publish(self) -> None:
        self.log.append(("publish",))


def setup(rooms: list[NodeRoom], placement: dict[str, list] | None = None):
    placement = placement or {"expert-e0-r0": [[0, 0]], "expert-e0-r1": [[0, 0]], "expert-e1-r0": [[0, 1]]}
    spec = PoolSpec("m", "float32", {}).with_actor_shards(placement)
    nodes = {"expert-e0-r0": "a", "expert-e0-r1": "b", "expert-e1-r0": "dead"}  # e1-r0's node is the one lost
    reg = ReplicaRegistry(spec, {n: ActorSlot(n, nodes.get(n, "a"), 1.0, 0.0, None) for n in placement})
    ops = FakeOps(set(placement), rooms)
    history, routers = ActivityLog(), RouterReports()
    config = ControllerConfig(drain_timeout_s=0.3, return_check_s=1.0)
    remapper = Remapper(reg, ops, history, routers, config)
    return reg, ops, history, routers, remapper, RestoreFlow(reg, ops, history, config, remapper)


def kinds(history: ActivityLog) -> list[str]:
    return [e["kind"] for e in history.events]


async def settle_until(history: ActivityLog, kind: str, polls: int) -> None:
    """Let restore tasks run until an event of `kind` is logged, or `polls` rounds have passed."""
    for _ in range(polls):
        await settle()
        if kind in kinds(history):
            return
        await asyncio.sleep(0.05)


async def settle() -> None:
    """Let the restore tasks a pass started finish."""
    for _ in range(20):
        await asyncio.sleep(0.01)
