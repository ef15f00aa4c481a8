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
stand-ins (again live), then releases the request.

A restarted controller rebuilds its state from what is alive (each expert actor knows its generation) and from a
small record in Ray's GCS key-value store (epoch, drained replicas), not from scratch.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from dataclasses import asdict, replace

import numpy as np
import ray

from .actor_slots import ActorSlot, NodeResources
from .controller_config import ControllerConfig
from .elastic import ElasticConfig, ElasticState, actor_slots, cluster_devices, control_step, current_placement
from .expert_actors import start_expert_actor
from .load_stats import merge_snapshots
from .lost_restore import LostActor, NodeRoom, RestorePlan, plan_restore, plan_return
from .mesh_store import MeshStore
from .naming import stand_in_actor_name
from .pool_spec import PoolSpec
from .router_gpus import NO_RESERVATION, RouterReservation, expert_nodes
from .shard_liveness import describe_shards, orphaned_by_removal
from .table_store import clear_table, publish_table, read_table

log = logging.getLogger(__name__)
_KEY = "controller"  # the controller's record, in its mesh's store (cluster/mesh_store.py)


def _kv_get(mesh_id: str) -> dict:
    raw = MeshStore(mesh_id).get(_KEY)
    return json.loads(raw) if raw else {}


def _kv_put(mesh_id: str, record: dict) -> None:
    MeshStore(mesh_id).put(_KEY, json.dumps(record).encode())


class Controller:
    """Runs as an async Ray actor (see `start_controller`)."""

    def __init__(self, spec: PoolSpec, slots: list[ActorSlot], config: ControllerConfig | None = None,
                 reservation: dict | None = None):
        """reservation: the GPUs and CPUs start-up kept for Serve router replicas (RouterReservation.as_dict());
        elastic plans and restores onto other nodes leave them alone."""
        self.spec = spec  # replaced (not mutated) when the placement changes
        self.reservation = RouterReservation.from_dict(reservation)
        self.slots = {s.name: s for s in slots}
        self.names = spec.names  # the mesh's namespace and stored keys; the same for every placement
        published = read_table(spec.mesh_id)
        if published is not None:
            # Ray restarts a crashed controller with its first arguments; the placement may have changed since.
            self.spec = spec.with_actor_shards(published["actor_shards"])
            self.slots.update({name: ActorSlot(**slot) for name, slot in published["slots"].items()})
        self.router_epochs: dict[str, tuple[float, int]] = {}  # router id -> (heard at, epoch it routes with)
        self._remap_lock = threading.Lock()  # one remap at a time, whichever thread's event loop asks
        self.config = (config or ControllerConfig()).validate()
        saved = _kv_get(spec.mesh_id)
        self.epoch = int(saved.get("epoch", 0))
        self.drained: set[str] = set(saved.get("drained", []))
        self.generations: dict[str, int] = {}
        self.nodes: dict[str, str] = {}  # actor -> node id it was last seen on
        self.restoring: set[str] = set()
        self.lost: set[str] = set()  # expected actors whose last probe failed (restoring or not)
        # A drain stops its actor after a grace period unless an undrain (or a newer drain) took over since.
        self._drain_tickets: dict[str, int] = {}
        self._ticket_counter = itertools.count(1)
        self.events: list[dict] = []
        self.loads: dict[str, tuple[float, dict]] = {}  # router id -> (received at, its latest load snapshot)
        self.started_at = time.time()
        self.restarted = bool(saved)  # a previous incarnation left a record
        # Lost actors not back at their normal share: name -> {"slot", "shards", "by": the stand-in hosting its
        # shards, or None while its shards run on their other replicas}. Moved back when a node with room joins.
        self.displaced: dict[str, dict] = dict(saved.get("displaced", {}))
        self.stand_in_serial = int(saved.get("stand_in_serial", 0))
        self.restore_request: list[dict] = list(saved.get("restore_request", []))  # bundles asked for
        self._returning = False
        self._last_return_check = 0.0
        self._first_pass = threading.Event()
        # The watch starts here, on a thread with its own event loop, so that every incarnation watches, including
        # one Ray restarted after a crash (nobody calls a method on it then).
        threading.Thread(target=lambda: asyncio.run(self._watch()), name="controller-watch", daemon=True).start()
        self.elastic = self.config.elastic
        self.elastic_state = ElasticState()
        self.control_log: list[dict] = []  # the latest control steps (status shows imbalance before/after)
        self.requested_gpus = 0
        if self.elastic is not None:
            threading.Thread(target=lambda: asyncio.run(self._control_loop()), name="controller-elastic",
                             daemon=True).start()

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> dict:
        """Wait until the first pass over the actors is done (idempotent); returns the state."""
        await asyncio.get_running_loop().run_in_executor(None, self._first_pass.wait, 60)
        return await self.get_state()

    async def _watch(self) -> None:
        while True:
            try:
                await self._check_all()
            except Exception:  # the watcher must outlive any one bad pass
                log.exception("controller pass failed")
            self._first_pass.set()
            # Not while a restore is under way: its remap and the return would each plan from a stale placement.
            if self.displaced and self.config.restore and not self._returning and not self.restoring \
                    and time.monotonic() - self._last_return_check >= self.config.return_check_s:
                self._last_return_check = time.monotonic()
                self._returning = True
                asyncio.get_running_loop().create_task(self._return_displaced())
            await asyncio.sleep(self.config.check_interval_s)

    def _expected(self) -> list[str]:
        return [name for name in self.spec.actor_shards if name not in self.drained]

    async def _check_all(self) -> None:
        names = [n for n in self._expected() if n not in self.restoring]
        results = await asyncio.gather(*(self._probe(n) for n in names))
        newly_lost = []
        for name, info in zip(names, results):
            if info is not None:
                self.generations[name] = info["generation"]
                self.nodes[name] = info["node_id"]
                self.lost.discard(name)
                continue
            self.lost.add(name)
            self._event("lost", name)
            if self.config.restore:
                self.restoring.add(name)
                newly_lost.append(name)
        if newly_lost:
            asyncio.get_running_loop().create_task(self._restore_lost(newly_lost))

    async def _probe(self, name: str) -> dict | None:
        try:
            handle = ray.get_actor(name, namespace=self.names.namespace)
        except ValueError:
            return None
        try:
            return await asyncio.wait_for(handle.info.remote(), self.config.ping_timeout_s)
        except Exception:
            # Hung or dying: make sure it is gone so the name is free for its replacement.
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
            return None

    async def _restore_lost(self, names: list[str]) -> None:
        """Bring back the actors one pass found lost: each at its normal share where a live node has room for it,
        the others through a re-plan onto the survivors (stand-ins, fewer replicas) while Ray's autoscaler is asked
        for the room."""
        try:
            plan = self._restore_plan(names)
        except Exception:  # resource tables unreadable: restore as before, Ray places them where it can
            log.exception("restore re-plan failed")
            plan = RestorePlan(full={n: self.slots[n] for n in names})
        restores = [self._restore(n, plan.full[n]) for n in names if n in plan.full]
        displaced = plan.displaced
        if displaced:
            restores.append(self._stand_in(plan))
        await asyncio.gather(*restores)

    def _restore_plan(self, names: list[str]) -> RestorePlan:
        rooms = self._rooms()
        # Its slot on the node it last ran on (a restore may have moved it from the slot's first node).
        lost = [LostActor(replace(self.slots[n], node_id=self.nodes.get(n) or self.slots[n].node_id),
                          tuple(map(tuple, self.spec.actor_shards[n]))) for n in names]
        serving = [n for n in self._expected() if n not in self.lost and n not in self.restoring]
        live_nodes: dict = {}
        for name in serving:
            for shard in self.spec.actor_shards[name]:
                live_nodes.setdefault(tuple(shard), set()).add(self.nodes.get(name) or self.slots[name].node_id)
        normal = [self.slots[n] for n in self._expected() if n not in names and not self._is_stand_in(n)]
        normal += [ActorSlot(**d["slot"]) for d in self.displaced.values()]
        return plan_restore(lost, rooms, live_nodes, normal, lambda i: stand_in_actor_name(self.stand_in_serial + i),
                            min_cpus=self.config.stand_in_min_cpus)

    def _is_stand_in(self, name: str) -> bool:
        return any(d["by"] == name for d in self.displaced.values())

    def _rooms(self) -> list[NodeRoom]:
        """Live nodes and what Ray has not given out on each (may lag a moment behind starts and deaths). A node
        where every actor of ours is lost is left out: Ray can call a node alive for seconds after it died."""
        from ray._private.state import available_resources_per_node

        available = available_resources_per_node()
        on_node: dict[str, list[str]] = {}
        for name in self._expected():
            if self.nodes.get(name):
                on_node.setdefault(self.nodes[name], []).append(name)
        suspect = {node for node, names in on_node.items() if all(n in self.lost for n in names)}
        return [NodeRoom(n["NodeID"], available.get(n["NodeID"], {}).get("CPU", 0.0),
                         available.get(n["NodeID"], {}).get("GPU", 0.0), n["Resources"].get("GPU", 0) > 0)
                for n in ray.nodes() if n["Alive"] and n["NodeID"] not in suspect]

    async def _stand_in(self, plan: RestorePlan) -> None:
        """Serve the lost shards the survivors have no room for as `plan` says: start its stand-ins, publish the
        placement without the displaced actors (live, like any remap), and ask for the normal shape."""
        displaced = plan.displaced
        self._event("restore_replanned", ",".join(displaced), reason=plan.reason, deferred=list(plan.deferred),
                    stand_ins={n: {"replaces": list(s.replaces), "node_id": s.slot.node_id, "num_cpus": s.slot.num_cpus,
                                   "num_gpus": s.slot.num_gpus} for n, s in plan.stand_ins.items()})
        self.stand_in_serial += len(plan.stand_ins)
        try:
            target = {n: s for n, s in self.spec.actor_shards.items() if n not in self.drained and n not in displaced}
            target.update({n: [list(x) for x in s.shards] for n, s in plan.stand_ins.items()})
            # Record the displaced before the remap retires them (it forgets their slots). A displaced stand-in hands
            # its own displaced actors on to whatever replaces it now.
            records = {}
            for name in displaced:
                by = next((n for n, s in plan.stand_ins.items() if name in s.replaces), None)
                hosted = [orig for orig, d in self.displaced.items() if d["by"] == name]
                for orig in hosted:
                    self.displaced[orig]["by"] = by
                if not hosted:
                    records[name] = {"slot": asdict(self.slots[name]),
                                     "shards": [list(x) for x in self.spec.actor_shards[name]], "by": by}
            self.displaced.update(records)
            self._persist()
            # Hard affinity: Ray would place a stand-in that reserves nothing on any node, not the one planned.
            result = await self._remap(target, {n: asdict(s.slot) for n, s in plan.stand_ins.items()}, soft=False)
            if not result.get("ok"):
                for name in records:
                    self.displaced.pop(name, None)
                self._persist()
                return  # the next pass finds them lost again and re-plans
            for name in displaced:
                self.lost.discard(name)
                self.nodes.pop(name, None)  # gone: it no longer counts towards its node's load (_node_for)
            self._set_restore_request(list(plan.request))
        except Exception as exc:
            self._event("restore_failed", ",".join(displaced), error=f"{type(exc).__name__}: {exc}"[:500])
        finally:
            self.restoring.difference_update(displaced)

    async def _return_displaced(self) -> None:
        """Displaced actors that fit at their normal share now (a node joined) start again under their own names;
        the stand-ins they had go (one live remap). With none displaced any more, the resource request goes."""
        try:
            groups: dict[str, list[LostActor]] = {}
            for name, d in sorted(self.displaced.items()):
                groups.setdefault(d["by"] or name, []).append(
                    LostActor(ActorSlot(**d["slot"]), tuple(map(tuple, d["shards"]))))
            serving = [n for n in self._expected() if n not in self.lost and n not in self.restoring]
            live_nodes: dict = {}
            for name in serving:
                for shard in self.spec.actor_shards[name]:
                    live_nodes.setdefault(tuple(shard), set()).add(self.nodes.get(name) or self.slots[name].node_id)
            back = plan_return(groups, self._rooms(), live_nodes)
            if not back:
                return
            returning = {name: slot for slots in back.values() for name, slot in slots.items()}
            retiring = [g for g in back if g in self.spec.actor_shards and g not in returning]
            target = {n: s for n, s in self.spec.actor_shards.items() if n not in self.drained and n not in retiring}
            target.update({n: self.displaced[n]["shards"] for n in returning})
            result = await self.apply_placement(target, {n: asdict(s) for n, s in returning.items()})
            if not result.get("ok"):
                return
            for name in returning:
                self.displaced.pop(name, None)
            self._event("moved_back", ",".join(sorted(returning)), retired=retiring, epoch=result["epoch"])
            if not self.displaced:
                self._set_restore_request([])
            self._persist()
        except Exception:
            log.exception("moving displaced actors back failed")
        finally:
            self._returning = False

    def _set_restore_request(self, bundles: list[dict]) -> None:
        if bundles == self.restore_request:
            return
        self.restore_request = bundles
        self._send_resource_request()
        self._event("request_resources", "-", gpus=self.requested_gpus, bundles=len(bundles),
                    reason="lost actors displaced" if bundles else "lost actors back at their normal share")

    def _send_resource_request(self, gpus: int | None = None) -> None:
        """One request for both needs (each call replaces the last): the elastic loop's GPUs (`gpus`, default
        what it asked for last) and the normal shape of a pool whose lost actors are displaced."""
        from ray.autoscaler.sdk import request_resources

        count = self.requested_gpus if gpus is None else gpus
        request_resources(bundles=[{"GPU": 1}] * count + list(self.restore_request))

    async def _restore(self, name: str, slot: ActorSlot | None = None) -> None:
        """slot: where to start it (its normal share on a node with room); None: its own slot."""
        started = time.time()
        try:
            generation = self.generations.get(name, 0) + 1
            handle = self._spawn(slot or self.slots[name], self.spec, generation)
            info = await asyncio.wait_for(handle.info.remote(), self.config.restore_timeout_s)  # after warm-up
            if name not in self.spec.actor_shards or name in self.drained:
                # A remap retired (or an operator drained) it while it was coming back: nobody routes to it.
                ray.kill(handle, no_restart=True)
                self._event("restore_dropped", name)
                return
            self.generations[name] = generation
            self.nodes[name] = info["node_id"]
            self.lost.discard(name)
            self.epoch += 1
            self._persist()
            self._event("restored", name, seconds=round(time.time() - started, 3), node_id=info["node_id"],
                        generation=generation)
        except Exception as exc:
            self._event("restore_failed", name, error=f"{type(exc).__name__}: {exc}"[:500])
        finally:
            self.restoring.discard(name)

    def _spawn(self, slot: ActorSlot, spec: PoolSpec, generation: int, soft: bool = True) -> ray.actor.ActorHandle:
        """Start slot.name (hosting spec.actor_shards[slot.name]) on the slot's node, or another if it is gone.
        soft False: only there (a stand-in whose share was cut to what that node has free)."""
        # soft affinity: _node_for can still pick a node that just died (ray.nodes() lags); Ray then places it
        # on any node with room.
        return start_expert_actor(replace(slot, node_id=self._node_for(slot)), spec, detached=True,
                                  generation=generation, soft_affinity=soft)

    def _node_for(self, slot: ActorSlot) -> str:
        """The slot's own node while it is alive; otherwise the live node (with GPUs, if the slot wants one)
        hosting the fewest of our actors."""
        alive = [n for n in ray.nodes() if n["Alive"]]
        if any(n["NodeID"] == slot.node_id for n in alive):
            return slot.node_id
        # GPUs kept for router replicas do not count: a node whose every GPU is kept (a router node) is no GPU node.
        kept = self.reservation.gpus
        fits = [n for n in alive if (n["Resources"].get("GPU", 0) - kept.get(n["NodeID"], 0) > 0) == (slot.num_gpus > 0)
                and n["Resources"].get("CPU", 0) >= slot.num_cpus] or alive
        load = {n["NodeID"]: sum(1 for v in self.nodes.values() if v == n["NodeID"]) for n in fits}
        return min(load, key=lambda node: (load[node], node))

    def _event(self, kind: str, actor: str, **detail) -> None:
        self.events.append({"t": time.time(), "kind": kind, "actor": actor, **detail})
        del self.events[:-1000]

    def _persist(self) -> None:
        _kv_put(self.names.mesh_id, {"epoch": self.epoch, "drained": sorted(self.drained), "displaced": self.displaced,
                 "stand_in_serial": self.stand_in_serial, "restore_request": self.restore_request})

    def _publish(self) -> None:
        """Publish the current placement (minus drained replicas) as the routing table at the current epoch."""
        serving = {n: s for n, s in self.spec.actor_shards.items() if n not in self.drained}
        # Lost actors this table retires: routers count them dead now, so a step waiting on them need not wait for
        # calls to them to time out before it switches to their stand-ins.
        gone = sorted(n for n in self.lost if n not in serving)
        publish_table(self.epoch, serving, {n: asdict(self.slots[n]) for n in serving if n in self.slots}, gone,
                      mesh_id=self.names.mesh_id)

    # ---- API (admin and routers) ---------------------------------------------------------------------------

    async def get_state(self) -> dict:
        return {
            "epoch": self.epoch,
            "actors": {name: {"node_id": self.nodes.get(name), "generation": self.generations.get(name, 0),
                              "restoring": name in self.restoring, "slot": asdict(self.slots[name])}
                       for name in self._expected()},
            "drained": sorted(self.drained),
            "events": list(self.events),
            "restarted": self.restarted,
            "started_at": self.started_at,
            "control": list(self.control_log),
            "requested_gpus": self.requested_gpus,
            "displaced": {n: {"by": d["by"], "slot": d["slot"]} for n, d in self.displaced.items()},
            "restore_request": list(self.restore_request),
        }

    async def report_load(self, router_id: str, snapshot: dict) -> None:
        """A router's latest load snapshot (cluster/load_stats.py format); routers push it every few seconds."""
        self.loads[router_id] = (time.time(), snapshot)

    async def load(self, max_age_s: float = 30.0) -> dict | None:
        """Every router's recent snapshot merged into one (counts summed, health recomputed), or None when no
        router reported within max_age_s. Routers that stopped reporting (scaled in, died) drop out."""
        now = time.time()
        for router_id in [r for r, (t, _) in self.loads.items() if now - t > max(max_age_s, 300.0)]:
            del self.loads[router_id]
        return merge_snapshots([snap for t, snap in self.loads.values() if now - t <= max_age_s])

    # ---- live remap --------------------------------------------------------------------------------------------

    async def ack_epoch(self, router_id: str, epoch: int) -> None:
        """A router routes with `epoch` now (sent after each switch and as a heartbeat)."""
        self.router_epochs[router_id] = (time.time(), int(epoch))

    def routers_behind(self, epoch: int) -> list[str]:
        """Live routers (heard from within router_ttl_s) that still route with an older table."""
        now = time.time()
        return sorted(r for r, (heard, e) in self.router_epochs.items()
                      if e < epoch and now - heard <= self.config.router_ttl_s)

    async def apply_placement(self, actor_shards: dict[str, list], slots: dict[str, dict]) -> dict:
        """Move to a new placement live: start the actors it adds and wait until each has loaded and warmed up,
        then publish the table (routers switch between steps), then wait until every router routes with it, and
        only then stop the actors it no longer names. No call ever goes to an actor that is not ready or already
        stopped, so no request fails and, since every replica of a shard computes the same thing, no result changes.

        actor_shards: the whole new placement, actor name -> [[layer, expert], ...]; an actor that stays must keep
        its shards (actors load their weights once). slots: ActorSlot fields for every actor this adds."""
        return await self._remap(actor_shards, slots)

    async def _remap(self, actor_shards: dict[str, list], slots: dict[str, dict], soft: bool = True) -> dict:
        """apply_placement, one at a time; soft False starts the added actors only on their slots' nodes."""
        await asyncio.get_running_loop().run_in_executor(None, self._remap_lock.acquire)
        try:
            return await self._apply_placement(actor_shards, slots, soft)
        finally:
            self._remap_lock.release()

    async def _apply_placement(self, actor_shards: dict[str, list], slots: dict[str, dict], soft: bool) -> dict:
        target_spec = self.spec.with_actor_shards(actor_shards)
        target = target_spec.actor_shards
        current = {n: s for n, s in self.spec.actor_shards.items() if n not in self.drained}
        changed = sorted(n for n in target if n in current and sorted(map(tuple, current[n])) != sorted(target[n]))
        if changed:
            raise ValueError(f"actor_shards: actors {changed} would change shards; give them new names")
        added = [n for n in target if n not in current]
        missing = [n for n in added if n not in slots]
        if missing:
            raise ValueError(f"slots: no slot for new actors {missing}")
        retired = sorted(n for n in current if n not in target)
        started = time.time()
        new_slots = {n: ActorSlot(**{**slots[n], "name": n}) for n in added}  # the key names the actor
        handles = {}
        for name in added:
            self.slots[name] = new_slots[name]
            handles[name] = self._spawn(new_slots[name], target_spec, 0, soft)
        infos = await asyncio.gather(
            *(asyncio.wait_for(h.info.remote(), self.config.restore_timeout_s) for h in handles.values()),
            return_exceptions=True)
        failed = {n: i for n, i in zip(handles, infos) if isinstance(i, BaseException)}
        if failed:
            for name, handle in handles.items():
                ray.kill(handle, no_restart=True)
                self.slots.pop(name, None)
            self._event("remap_failed", ",".join(sorted(failed)), error=repr(next(iter(failed.values())))[:500])
            return {"ok": False, "epoch": self.epoch, "failed": sorted(failed)}
        for name, info in zip(handles, infos):
            self.generations[name] = info["generation"]
            self.nodes[name] = info["node_id"]
        self.spec = target_spec
        self.drained -= set(retired)
        self.epoch += 1
        epoch = self.epoch
        self._publish()
        self._persist()
        ready_s = round(time.time() - started, 3)
        self._event("remap", ",".join(added) or "-", epoch=epoch, added=added, retired=retired, ready_s=ready_s)
        deadline = time.time() + self.config.drain_timeout_s
        while self.routers_behind(epoch) and time.time() < deadline:
            await asyncio.sleep(0.1)
        behind = self.routers_behind(epoch)
        for name in retired:
            try:
                ray.kill(ray.get_actor(name, namespace=self.names.namespace), no_restart=True)
            except ValueError:
                pass
            self.slots.pop(name, None)
            self._event("retired", name, epoch=epoch)
        return {"ok": True, "epoch": epoch, "added": added, "retired": retired, "ready_s": ready_s,
                "switch_s": round(time.time() - started - ready_s, 3), "routers_behind": behind}

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
            return self._log_control({"reason": "no load reported"})
        layer_ids = list(snapshot["layers"])
        load = np.asarray(snapshot["counts"]["shard_load"], dtype=np.float64)
        nodes = [NodeResources(n["NodeID"], n["Resources"].get("CPU", 0.0), int(n["Resources"].get("GPU", 0)))
                 for n in ray.nodes() if n["Alive"]]
        devices = cluster_devices(expert_nodes(nodes, self.reservation), cfg.slots_per_gpu)
        running = {n: [tuple(x) for x in sh] for n, sh in self.spec.actor_shards.items() if n not in self.drained}
        actor_device = {}
        for name in running:
            slot = self.slots.get(name)
            node = self.nodes.get(name) or (slot.node_id if slot else None)
            if node not in devices.node_ids or name in self.restoring:
                return self._log_control({"reason": f"{name} is not placed on a live device yet (failover first)"})
            local = slot.gpu_slot if (slot is not None and devices.has_gpus and slot.gpu_slot is not None) else 0
            actor_device[name] = devices.node_ids.index(node) * devices.topology.gpus_per_node + local
        current = current_placement(running, actor_device, devices, layer_ids, int(snapshot["num_experts"]))
        outcome, self.elastic_state = control_step(time.monotonic(), load, current, running, layer_ids,
                                                   self.elastic_state, cfg)
        entry = {"reason": outcome.reason, "imbalance_before": outcome.imbalance_before,
                 "imbalance_after": outcome.imbalance_after, "replicas_before": outcome.replicas_before,
                 "replicas_after": outcome.replicas_after, "window_slots": float(load.sum())}
        if outcome.request_gpus is not None and outcome.request_gpus != self.requested_gpus:
            self._request_gpus(outcome.request_gpus)
            entry["request_gpus"] = outcome.request_gpus
        if outcome.transition is not None:
            step = outcome.transition
            per_node: dict[str, int] = {}
            for name in running:
                node = devices.node_ids[actor_device[name] // devices.topology.gpus_per_node]
                per_node[node] = per_node.get(node, 0) + 1
            slots = actor_slots(step.start, devices, cfg, per_node)
            entry["remap"] = await self.apply_placement(step.actors, {n: asdict(s) for n, s in slots.items()})
        return self._log_control(entry)

    def _request_gpus(self, count: int) -> None:
        """Ask Ray's autoscaler for a cluster that can hold `count` one-GPU bundles (0 releases the request)."""
        self._send_resource_request(gpus=count)
        self._event("request_resources", "-", gpus=count)
        self.requested_gpus = count  # last: a caller that sees the count sees the event too

    def _log_control(self, entry: dict) -> dict:
        entry = {"t": time.time(), **entry}
        self.control_log.append(entry)
        del self.control_log[:-50]
        return entry

    # ---- operator actions (Admin API) ------------------------------------------------------------------------

    def down(self) -> set[str]:
        """Actors that serve nothing now: drained, lost (last probe failed) or being restored."""
        return set(self.drained) | self.lost | self.restoring

    async def liveness(self) -> dict:
        """What routers need for their health verdict, cheaply: {"drained": [...], "down": [...]}."""
        return {"drained": sorted(self.drained), "down": sorted(self.down())}

    def _refusal(self, name: str, verb: str, force: bool) -> dict | None:
        """NOT_FOUND for an actor this controller does not run; FAILED_PRECONDITION when taking `name` out would
        leave a shard with no live replica and the caller did not force it."""
        if name not in self.spec.actor_shards:
            return _outcome("NOT_FOUND", f"actor: no expert replica named {name!r}")
        orphaned = orphaned_by_removal(self.spec.actor_shards, self.down(), name)
        if orphaned and not force:
            return _outcome("FAILED_PRECONDITION",
                            f"{verb} {name} would leave no live replica of {describe_shards(orphaned)}; requests "
                            f"for them would wait and fail. Add replicas first, or set force to do it anyway")
        return None

    async def kill_replica(self, name: str, force: bool = False) -> dict:
        """Kill `name` now (a failover drill); the watch restores it. -> {"code", "message"} (code "OK" or a gRPC
        status name)."""
        refused = self._refusal(name, "killing", force)
        if refused is not None:
            return refused
        try:
            ray.kill(ray.get_actor(name, namespace=self.names.namespace), no_restart=True)
        except ValueError:
            return _outcome("FAILED_PRECONDITION", f"{name} is not running (already lost or drained)")
        self._event("killed", name, forced=force)
        return _outcome("OK", f"killed {name}")

    async def drain_replica(self, name: str, force: bool = False, grace_s: float = 5.0) -> dict:
        """Stop restoring `name`, let routers stop using it, then stop it after `grace_s` for in-flight calls."""
        if name in self.drained:
            return _outcome("FAILED_PRECONDITION", f"{name} is already drained")
        refused = self._refusal(name, "draining", force)
        if refused is not None:
            return refused
        self.drained.add(name)
        ticket = self._drain_tickets[name] = next(self._ticket_counter)
        self.epoch += 1
        self._persist()
        self._publish()  # routers stop sending it calls at their next step
        self._event("draining", name, forced=force)

        def stop_later() -> None:
            time.sleep(grace_s)
            if self._drain_tickets.get(name) != ticket:
                return  # undrained (or drained again) in the meantime: that call owns the actor now
            try:
                ray.kill(ray.get_actor(name, namespace=self.names.namespace), no_restart=True)
            except ValueError:
                pass
            self._event("drained", name)

        threading.Thread(target=stop_later, daemon=True).start()
        return _outcome("OK", f"draining {name}")

    async def undrain_replica(self, name: str) -> dict:
        """Put a drained replica back: the same actor if it is still up (within the drain's grace), else a new one
        started on its slot and warmed up; then publish it, so routers route to it again."""
        if name not in self.spec.actor_shards:
            return _outcome("NOT_FOUND", f"actor: no expert replica named {name!r}")
        if name not in self.drained:
            return _outcome("FAILED_PRECONDITION", f"{name} is not drained")
        if name not in self.slots:
            return _outcome("FAILED_PRECONDITION", f"{name}: no record of where it ran; cannot start it again")
        self._drain_tickets.pop(name, None)  # the pending stop of the drain must not kill what comes back
        info = await self._probe(name)
        started = time.time()
        if info is None:
            generation = self.generations.get(name, 0) + 1
            try:
                handle = self._spawn(self.slots[name], self.spec, generation)
                info = await asyncio.wait_for(handle.info.remote(), self.config.restore_timeout_s)
            except Exception as exc:
                self._event("undrain_failed", name, error=f"{type(exc).__name__}: {exc}"[:500])
                return _outcome("UNAVAILABLE", f"{name} did not start again: {type(exc).__name__}")
        if name not in self.drained or name not in self.spec.actor_shards:
            return _outcome("FAILED_PRECONDITION", f"{name} changed while it was starting (undrained or remapped)")
        self.generations[name] = info["generation"]
        self.nodes[name] = info["node_id"]
        self.lost.discard(name)
        self.drained.discard(name)
        self.epoch += 1
        self._persist()
        self._publish()  # routers look it up by name, wait until it answers, and route to it from their next step
        self._event("undrained", name, seconds=round(time.time() - started, 3), generation=info["generation"])
        return _outcome("OK", f"undrained {name}")


def _outcome(code: str, message: str) -> dict:
    """An operator action's result: code "OK" or the gRPC status name the Admin API answers with."""
    return {"code": code, "message": message}


def start_controller(spec: PoolSpec, slots: list[ActorSlot], config: ControllerConfig | None = None,
                     fresh: bool = True, reservation: RouterReservation | None = None) -> ray.actor.ActorHandle:
    """Create (or find) the controller actor and start it watching. fresh=True clears a record left by an
    earlier deployment on this cluster. reservation: the GPUs kept for Serve router replicas."""
    names = spec.names
    if fresh:
        _kv_put(spec.mesh_id, {})
        clear_table(spec.mesh_id)
    try:
        handle = ray.get_actor(names.controller, namespace=names.namespace)
    except ValueError:
        handle = ray.remote(Controller).options(
            name=names.controller, namespace=names.namespace, lifetime="detached", max_restarts=-1,
            max_concurrency=64, num_cpus=0,
        ).remote(spec, list(slots), config or ControllerConfig(), (reservation or NO_RESERVATION).as_dict())
    ray.get(handle.start.remote())
    return handle
