"""The controller's Ray calls, in one place: find and probe an expert actor by name, start and kill one, read the
cluster's nodes and free resources, ask Ray's autoscaler for a cluster shape, persist the controller's record and
publish the routing table (`RayActorOps` bundles them for the flows). Everything decided from their answers lives in
pure modules (replica_registry, node_choice, displacement, elastic, restore_flow, remap_flow)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import ray

from .actor_slots import ActorSlot
from .controller_record import save_record
from .displacement import resource_bundles
from .expert_actors import start_expert_actor
from .lost_restore import NodeRoom
from .node_choice import choose_node, node_rooms
from .pool_spec import PoolSpec
from .replica_registry import SILENT, ReplicaRegistry
from .router_gpus import RouterReservation
from .table_store import publish_table


async def probe_actor(name: str, namespace: str, timeout_s: float) -> dict | str | None:
    """The actor's info() ({"generation", "node_id", ...}); SILENT when it did not answer within timeout_s (left
    alone: it may only be busy; the controller kills it after config.probe_misses such probes in a row); None when
    it is not registered or died answering (then killed, so the name is free for its replacement)."""
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
    try:
        return await asyncio.wait_for(handle.info.remote(), timeout_s)
    except asyncio.TimeoutError:
        return SILENT
    except Exception:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:
            pass
        return None


def kill_actor(name: str, namespace: str) -> bool:
    """Kill the named actor for good; False when no actor has that name."""
    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    except ValueError:
        return False
    return True


def _named_holder(name: str, namespace: str) -> tuple[object, str, str, bool] | None:
    """(handle, state, node id, has a worker) of the actor holding `name`, from Ray's actor table; None when no actor
    holds the name. The node id is "" while the holder is not placed. Ray names a node as soon as it picks one, also
    for an actor queued there for want of room; only a worker process (a pid, an address) means it got its share."""
    from ray._private import state  # as router_service/node_watch.py: the public state API needs the dashboard

    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
    info = state.actors(actor_id=handle._actor_id.hex()) or {}
    node = (info.get("Address") or {}).get("NodeID") or ""
    worker = bool(info.get("Pid") or (info.get("Address") or {}).get("Port"))
    return handle, info.get("State", ""), node if node.strip("f0") else "", worker


def named_actor_node(name: str, namespace: str) -> tuple[str, str] | None:
    """(state, node id) of the actor holding `name`; None when no actor holds the name ("" node: not placed)."""
    holder = _named_holder(name, namespace)
    return None if holder is None else holder[1:3]


def named_actor_has_worker(name: str, namespace: str) -> bool | None:
    """Whether Ray gave the actor holding `name` a worker process (its share on a node); False while it waits in a
    queue for room (or for its worker to start); None when no actor holds the name."""
    holder = _named_holder(name, namespace)
    return None if holder is None else holder[3]


def release_stale_name(name: str, namespace: str) -> bool:
    """Kill the actor holding `name` if Ray's actor table places it on a node that is no longer alive (a restore
    waiting on a name Ray has not released after its node died); True when one was killed. A holder on a live node,
    or one not placed yet, is left alone: it may be a replacement some other pass just started."""
    holder = _named_holder(name, namespace)
    if holder is None or not holder[2] or holder[2] in {n["NodeID"] for n in alive_nodes()}:
        return False
    ray.kill(holder[0], no_restart=True)
    return True


def alive_nodes() -> list[dict]:
    """ray.nodes() entries of the live nodes (may lag a moment behind a node's death)."""
    return [n for n in ray.nodes() if n["Alive"]]


def free_resources() -> dict[str, dict[str, float]]:
    """node id -> what Ray has not given out on it ({"CPU": .., "GPU": ..})."""
    from ray._private.state import available_resources_per_node

    return available_resources_per_node()


def request_bundles(bundles: list[dict]) -> None:
    """Ask Ray's autoscaler for a cluster that can hold `bundles` (replaces the previous request; [] releases)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


class RayActorOps:
    """What the controller's flows (cluster/restore_flow.py, cluster/remap_flow.py) do to the world, done with Ray:
    start, await, kill expert actors; read the nodes; ask the autoscaler; persist the record and publish the table.
    Tests give the flows a fake with the same methods instead."""

    def __init__(self, registry: ReplicaRegistry, reservation: RouterReservation):
        self.reg = registry
        self.names = registry.spec.names  # the same for every placement
        self.reservation = reservation

    def spawn(self, slot: ActorSlot, spec: PoolSpec, generation: int, soft: bool = True) -> ray.actor.ActorHandle:
        """Start slot.name (hosting spec.actor_shards[slot.name]) on the slot's node, or another if it is gone.
        soft False: only there (a stand-in whose share was cut to what that node has free)."""
        # soft affinity: choose_node can still pick a node that just died (ray.nodes() lags); Ray then places it
        # on any node with room.
        node = choose_node(slot, alive_nodes(), self.reservation.gpus, self.reg.nodes.values())
        return start_expert_actor(replace(slot, node_id=node), spec, detached=True, generation=generation,
                                  soft_affinity=soft)

    async def ready(self, handle: ray.actor.ActorHandle, timeout_s: float) -> dict:
        """The actor's info() once it loaded and warmed up; raises after timeout_s or when it died."""
        return await asyncio.wait_for(handle.info.remote(), timeout_s)

    def kill(self, handle: ray.actor.ActorHandle) -> None:
        ray.kill(handle, no_restart=True)

    def kill_named(self, name: str) -> bool:
        return kill_actor(name, self.names.namespace)

    async def probe(self, name: str, timeout_s: float) -> dict | str | None:
        return await probe_actor(name, self.names.namespace, timeout_s)

    def release_stale_name(self, name: str) -> bool:
        return release_stale_name(name, self.names.namespace)

    def actor_node(self, name: str) -> str | None:
        """The node Ray runs the live holder of `name` on; None when no live, placed actor holds it."""
        holder = named_actor_node(name, self.names.namespace)
        return holder[1] or None if holder is not None and holder[0] == "ALIVE" else None

    def placed(self, name: str) -> bool | None:
        """Whether Ray has given the actor holding `name` its share and a worker on a node (False: queued, no room for
        its share where it was sent); None when no actor holds the name or Ray's table is unreadable."""
        try:
            return named_actor_has_worker(name, self.names.namespace)
        except Exception:
            return None

    def rooms(self) -> list[NodeRoom]:
        """Live nodes and what Ray has not given out on each, less nodes where every actor of ours is lost."""
        return node_rooms(alive_nodes(), free_resources(), self.reg.suspect_nodes())

    def request_resources(self, gpus: int | None = None) -> None:
        """One request for both needs (each call replaces the last): the elastic loop's GPUs (`gpus`, default what
        it asked for last) and the normal shape of a pool whose lost actors are displaced."""
        count = self.reg.requested_gpus if gpus is None else gpus
        request_bundles(resource_bundles(count, self.reg.restore_request))

    def persist(self) -> None:
        save_record(self.names.mesh_id, self.reg.record())

    def publish(self) -> None:
        """Publish the current placement (minus drained replicas) as the routing table at the current epoch."""
        serving, slots, gone = self.reg.table()
        publish_table(self.reg.epoch, serving, slots, gone, mesh_id=self.names.mesh_id)
