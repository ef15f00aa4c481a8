"""The controller: a named, detached, restartable Ray actor that keeps every expert replica alive.

It checks each expected expert actor every `check_interval_s` (is the name registered, does it answer a ping) and
restores a lost one: a new actor under the same name, weights reloaded from the checkpoint, a warm-up forward
inside the actor before it reports ready. Routers find the restored replica by name, so the data plane never
waits for the controller; while the controller is down or restarting, routers keep serving on what they have.

When the survivors have no room to restore a lost actor at its normal share (a node lost on a full cluster), the
controller re-plans instead (cluster/lost_restore.py): stand-ins with smaller shares, or the lost shards merged into
fewer stand-ins, started and published live like any remap (a router step waiting for the lost shards switches to
them); a shard that still has a live replica waits with fewer replicas. It asks Ray's autoscaler for the normal
shape, and when a node with room joins, it starts the lost actors again under their own names and retires the
stand-ins (again live), then releases the request (cluster/displacement.py keeps that bookkeeping).

A restarted controller rebuilds its state from what is alive (each expert actor knows its generation) and from a
small record in Ray's GCS key-value store (cluster/controller_record.py: epoch, drained and displaced replicas).

This class is the Ray shell. Its state lives in plain objects (replica_registry.ReplicaRegistry: the replicas and
what the watch learned; router_reports.RouterReports: routers' epochs and load; activity_log.ActivityLog: events and
control steps), the watch and restores in restore_flow.RestoreFlow, live remaps in remap_flow.Remapper, the elastic
decision in control_pass, refusals of operator actions in admin_checks, and every Ray call in ray_ops (RayActorOps).
What stays here: the actor's methods and its two loops (the watch, the elastic control step).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time

import ray

from .activity_log import ActivityLog
from .actor_slots import ActorSlot
from .admin_checks import drain_refusal, outcome, removal_refusal, undrain_refusal
from .control_pass import control_pass
from .controller_config import ControllerConfig
from .controller_placement import ControllerPlacement, choose_controller_placement
from .controller_record import clear_record, load_record
from .elastic import ElasticConfig, ElasticState
from .placement_claims import ClaimLedger
from .pool_spec import PoolSpec
from .ray_ops import RayActorOps, alive_nodes
from .remap_flow import Remapper
from .replica_registry import SILENT, ReplicaRegistry
from .restore_flow import RestoreFlow
from .router_gpus import NO_RESERVATION, RouterReservation
from .router_reports import RouterReports
from .table_store import clear_table, read_table

log = logging.getLogger(__name__)


class Controller:
    """Runs as an async Ray actor (see `start_controller`)."""

    def __init__(self, spec: PoolSpec, slots: list[ActorSlot], config: ControllerConfig | None = None,
                 reservation: dict | None = None):
        """reservation: the GPUs and CPUs start-up kept for Serve router replicas (RouterReservation.as_dict());
        elastic plans and restores onto other nodes leave them alone."""
        self.reservation = RouterReservation.from_dict(reservation)
        self.config = (config or ControllerConfig()).validate()
        record, self.restarted = load_record(spec.mesh_id)  # restarted: a previous incarnation left a record
        self.reg = ReplicaRegistry.resume(spec, slots, read_table(spec.mesh_id), record,
                                          ClaimLedger(self.config.claim_ttl_s))
        self.routers = RouterReports()
        self.history = ActivityLog()
        self.ops = RayActorOps(self.reg, self.reservation)
        self.remapper = Remapper(self.reg, self.ops, self.history, self.routers, self.config)
        self.restorer = RestoreFlow(self.reg, self.ops, self.history, self.config, self.remapper)
        # A drain stops its actor after a grace period unless an undrain (or a newer drain) took over since.
        self._drain_tickets: dict[str, int] = {}
        self._ticket_counter = itertools.count(1)
        self.started_at = time.time()
        self._first_pass = threading.Event()
        # The watch starts here, on a thread with its own event loop, so that every incarnation watches, including
        # one Ray restarted after a crash (nobody calls a method on it then).
        threading.Thread(target=lambda: asyncio.run(self._watch()), name="controller-watch", daemon=True).start()
        self.elastic = self.config.elastic
        self.elastic_state = ElasticState()
        if self.elastic is not None:
            threading.Thread(target=lambda: asyncio.run(self._control_loop()), name="controller-elastic",
                             daemon=True).start()

    async def start(self) -> dict:
        """Wait until the first pass over the actors is done (idempotent); returns the state."""
        await asyncio.get_running_loop().run_in_executor(None, self._first_pass.wait, 60)
        return await self.get_state()

    async def _watch(self) -> None:
        if self.config.node_poll_s > 0:
            asyncio.get_running_loop().create_task(self._node_watch())
        while True:
            try:
                await self.restorer.check_all()
            except Exception:  # the watcher must outlive any one bad pass
                log.exception("controller pass failed")
            self._first_pass.set()
            if self.restorer.return_due(time.monotonic()):
                asyncio.get_running_loop().create_task(self.restorer.return_displaced())
            await asyncio.sleep(self.config.check_interval_s)

    async def _node_watch(self) -> None:
        """Read Ray's node table every node_poll_s: actors on a node that died are restored at once, together
        (restore_flow.RestoreFlow.node_check), while their probes in the watch may still be waiting to time out."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                snapshot = await loop.run_in_executor(None, ray.nodes)
                self.restorer.node_check(snapshot)
            except Exception:  # the watch must outlive any one bad poll (a GCS hiccup)
                log.exception("controller node poll failed")
            await asyncio.sleep(self.config.node_poll_s)

    # ---- API (admin and routers) ---------------------------------------------------------------------------

    async def get_state(self) -> dict:
        reg = self.reg
        return {
            "epoch": reg.epoch,
            "actors": reg.actors_view(),
            "drained": sorted(reg.drained),
            "events": list(self.history.events),
            "restarted": self.restarted,
            "started_at": self.started_at,
            "control": list(self.history.control),
            "requested_gpus": reg.requested_gpus,
            "displaced": reg.displaced_view(),
            "restore_request": list(reg.restore_request),
            # Placements planned but not yet counted by Ray (cluster/placement_claims.py): live count, each claim,
            # and how the ended ones ended.
            "claims": reg.claims.view(),
        }

    async def report_load(self, router_id: str, snapshot: dict) -> None:
        """A router's latest load snapshot (cluster/load_stats.py format); routers push it every few seconds."""
        self.routers.report_load(router_id, snapshot, time.time())

    async def load(self, max_age_s: float = 30.0) -> dict | None:
        """Every router's recent snapshot merged into one (counts summed, health recomputed), or None when no
        router reported within max_age_s. Routers that stopped reporting (scaled in, died) drop out."""
        return self.routers.merged_load(time.time(), max_age_s)

    # ---- live remap --------------------------------------------------------------------------------------------

    async def ack_epoch(self, router_id: str, epoch: int) -> None:
        """A router routes with `epoch` now (sent after each switch and as a heartbeat)."""
        self.routers.ack(router_id, epoch, time.time())

    def routers_behind(self, epoch: int) -> list[str]:
        """Live routers (heard from within router_ttl_s) that still route with an older table."""
        return self.remapper.routers_behind(epoch)

    async def apply_placement(self, actor_shards: dict[str, list], slots: dict[str, dict]) -> dict:
        """Move to a new placement live (cluster/remap_flow.py): start the actors it adds and wait until each has
        loaded and warmed up, publish the table, wait until every router routes with it, and only then stop the
        actors it no longer names, so no request fails and no result changes.

        actor_shards: the whole new placement, actor name -> [[layer, expert], ...]; an actor that stays must keep
        its shards (actors load their weights once). slots: ActorSlot fields for every actor this adds."""
        return await self.remapper.remap(actor_shards, slots)

    # ---- elasticity ----------------------------------------------------------------------------------------------

    async def _control_loop(self) -> None:
        while True:
            await asyncio.sleep(self.elastic.control_interval_s)
            try:
                await self.control_once()
            except Exception:  # the loop must outlive any one bad pass
                log.exception("elastic control pass failed")

    async def control_once(self) -> dict:
        """One elastic control step: merged router load -> autoscale policy + planner -> live remap. Returns what
        it decided (also kept for `expertmesh status`)."""
        cfg = self.elastic or ElasticConfig()
        snapshot = await self.load(max_age_s=max(3 * cfg.control_interval_s, 10.0))
        if snapshot is None:
            return self.history.control_step({"reason": "no load reported"})
        decided, self.elastic_state = control_pass(time.monotonic(), snapshot, alive_nodes(), self.reservation,
                                                   self.reg, self.elastic_state, cfg)
        entry = dict(decided.entry)
        if decided.request_gpus is not None and decided.request_gpus != self.reg.requested_gpus:
            self._request_gpus(decided.request_gpus)
            entry["request_gpus"] = decided.request_gpus
        if decided.placement is not None:
            entry["remap"] = await self.apply_placement(decided.placement, decided.new_slots)
        return self.history.control_step(entry)

    def _request_gpus(self, count: int) -> None:
        """Ask Ray's autoscaler for a cluster that can hold `count` one-GPU bundles (0 releases the request)."""
        self.ops.request_resources(gpus=count)
        self.history.event("request_resources", "-", gpus=count)
        self.reg.requested_gpus = count  # last: a caller that sees the count sees the event too

    # ---- operator actions (Admin API) ------------------------------------------------------------------------

    def down(self) -> set[str]:
        """Actors that serve nothing now: drained, lost (last probe failed) or being restored."""
        return self.reg.down()

    async def liveness(self) -> dict:
        """What routers need for their health verdict, cheaply: {"drained": [...], "down": [...]}."""
        return {"drained": sorted(self.reg.drained), "down": sorted(self.reg.down())}

    async def kill_replica(self, name: str, force: bool = False) -> dict:
        """Kill `name` now (a failover drill); the watch restores it. -> {"code", "message"} (code "OK" or a gRPC
        status name)."""
        refused = removal_refusal(self.reg, name, "killing", force)
        if refused is not None:
            return refused
        if not self.ops.kill_named(name):
            return outcome("FAILED_PRECONDITION", f"{name} is not running (already lost or drained)")
        self.history.event("killed", name, forced=force)
        return outcome("OK", f"killed {name}")

    async def drain_replica(self, name: str, force: bool = False, grace_s: float = 5.0) -> dict:
        """Stop restoring `name`, let routers stop using it, then stop it after `grace_s` for in-flight calls."""
        refused = drain_refusal(self.reg, name, force)
        if refused is not None:
            return refused
        self.reg.drained.add(name)
        ticket = self._drain_tickets[name] = next(self._ticket_counter)
        self.reg.epoch += 1
        self.ops.persist()
        self.ops.publish()  # routers stop sending it calls at their next step
        self.history.event("draining", name, forced=force)

        def stop_later() -> None:
            time.sleep(grace_s)
            if self._drain_tickets.get(name) != ticket:
                return  # undrained (or drained again) in the meantime: that call owns the actor now
            self.ops.kill_named(name)
            self.history.event("drained", name)

        threading.Thread(target=stop_later, daemon=True).start()
        return outcome("OK", f"draining {name}")

    async def undrain_replica(self, name: str) -> dict:
        """Put a drained replica back: the same actor if it is still up (within the drain's grace), else a new one
        started on its slot and warmed up; then publish it, so routers route to it again."""
        reg = self.reg
        refused = undrain_refusal(reg, name)
        if refused is not None:
            return refused
        self._drain_tickets.pop(name, None)  # the pending stop of the drain must not kill what comes back
        info = await self.ops.probe(name, self.config.ping_timeout_s)
        started = time.time()
        if info == SILENT:  # up but not answering: start a fresh one in its place, as for one that is gone
            self.ops.kill_named(name)
            info = None
        if info is None:
            try:
                handle = self.ops.spawn(reg.slot_of(name), reg.spec, reg.generations.get(name, 0) + 1)
                info = await self.ops.ready(handle, self.config.restore_timeout_s)
            except Exception as exc:
                self.history.event("undrain_failed", name, error=f"{type(exc).__name__}: {exc}"[:500])
                return outcome("UNAVAILABLE", f"{name} did not start again: {type(exc).__name__}")
        if name not in reg.drained or name not in reg.spec.actor_shards:
            return outcome("FAILED_PRECONDITION", f"{name} changed while it was starting (undrained or remapped)")
        reg.seen(name, info)
        reg.drained.discard(name)
        reg.epoch += 1
        self.ops.persist()
        self.ops.publish()  # routers look it up by name, wait until it answers, and route to it from their next step
        self.history.event("undrained", name, seconds=round(time.time() - started, 3), generation=info["generation"])
        return outcome("OK", f"undrained {name}")


def start_controller(spec: PoolSpec, slots: list[ActorSlot], config: ControllerConfig | None = None,
                     fresh: bool = True, reservation: RouterReservation | None = None) -> ray.actor.ActorHandle:
    """Create (or find) the controller actor and start it watching. fresh=True clears a record left by an
    earlier deployment on this cluster. reservation: the GPUs kept for Serve router replicas."""
    names = spec.names
    if fresh:
        clear_record(spec.mesh_id)
        clear_table(spec.mesh_id)
    config = config or ControllerConfig()
    try:
        handle = ray.get_actor(names.controller, namespace=names.namespace)
    except ValueError:
        placement = choose_controller_placement(config.placement, config.num_cpus, ray.nodes(),
                                                {s.node_id for s in slots if s.node_id})
        log.info("controller placement: %s", placement.reason)
        handle = ray.remote(Controller).options(
            name=names.controller, namespace=names.namespace, lifetime="detached", max_restarts=-1,
            max_concurrency=64, **placement_options(placement),
        ).remote(spec, list(slots), config, (reservation or NO_RESERVATION).as_dict())
    ray.get(handle.start.remote())
    return handle


def placement_options(placement: ControllerPlacement) -> dict:
    """The choice as ray.remote().options keywords."""
    options: dict = {"num_cpus": placement.num_cpus}
    if placement.resources:
        options["resources"] = dict(placement.resources)
    if placement.node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # soft: a controller Ray restarts after that node died still finds a node
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(placement.node_id, soft=True)
    return options
