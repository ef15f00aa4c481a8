"""The controller: a named, detached, restartable Ray actor that keeps every expert replica alive.

It checks each expected expert actor every `check_interval_s` (is the name registered, does it answer a ping) and
restores a lost one: a new actor under the same name, weights reloaded from the checkpoint, a warm-up forward
inside the actor before it reports ready. Routers find the restored replica by name, so the data plane never
waits for the controller; while the controller is down or restarting, routers keep serving on what they have.

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
from .naming import CONTROLLER_NAME, NAMESPACE
from .pool_spec import PoolSpec
from .shard_liveness import describe_shards, orphaned_by_removal
from .table_store import clear_table, publish_table, read_table

log = logging.getLogger(__name__)
_KV_KEY = b"expertmesh/controller"


def _kv_get() -> dict:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_KV_KEY)
    return json.loads(raw) if raw else {}


def _kv_put(record: dict) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_KV_KEY, json.dumps(record).encode(), overwrite=True)


class Controller:
    """Runs as an async Ray actor (see `start_controller`)."""

    def __init__(self, spec: PoolSpec, slots: list[ActorSlot], config: ControllerConfig | None = None):
        self.spec = spec  # replaced (not mutated) when the placement changes
        self.slots = {s.name: s for s in slots}
        published = read_table()
        if published is not None:
            # Ray restarts a crashed controller with its first arguments; the placement may have changed since.
            self.spec = spec.with_actor_shards(published["actor_shards"])
            self.slots.update({name: ActorSlot(**slot) for name, slot in published["slots"].items()})
        self.router_epochs: dict[str, tuple[float, int]] = {}  # router id -> (heard at, epoch it routes with)
        self._remap_lock = threading.Lock()  # one remap at a time, whichever thread's event loop asks
        self.config = (config or ControllerConfig()).validate()
        saved = _kv_get()
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
            await asyncio.sleep(self.config.check_interval_s)

    def _expected(self) -> list[str]:
        return [name for name in self.spec.actor_shards if name not in self.drained]

    async def _check_all(self) -> None:
        names = [n for n in self._expected() if n not in self.restoring]
        results = await asyncio.gather(*(self._probe(n) for n in names))
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
                asyncio.get_running_loop().create_task(self._restore(name))

    async def _probe(self, name: str) -> dict | None:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
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

    async def _restore(self, name: str) -> None:
        started = time.time()
        try:
            generation = self.generations.get(name, 0) + 1
            handle = self._spawn(self.slots[name], self.spec, generation)
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

    def _spawn(self, slot: ActorSlot, spec: PoolSpec, generation: int) -> ray.actor.ActorHandle:
        """Start slot.name (hosting spec.actor_shards[slot.name]) on the slot's node, or another if it is gone."""
        # soft affinity: _node_for can still pick a node that just died (ray.nodes() lags); Ray then places it
        # on any node with room.
        return start_expert_actor(replace(slot, node_id=self._node_for(slot)), spec, detached=True,
                                  generation=generation, soft_affinity=True)

    def _node_for(self, slot: ActorSlot) -> str:
        """The slot's own node while it is alive; otherwise the live node (with GPUs, if the slot wants one)
        hosting the fewest of our actors."""
        alive = [n for n in ray.nodes() if n["Alive"]]
        if any(n["NodeID"] == slot.node_id for n in alive):
            return slot.node_id
        fits = [n for n in alive if (n["Resources"].get("GPU", 0) > 0) == (slot.num_gpus > 0)
                and n["Resources"].get("CPU", 0) >= slot.num_cpus] or alive
        load = {n["NodeID"]: sum(1 for v in self.nodes.values() if v == n["NodeID"]) for n in fits}
        return min(load, key=lambda node: (load[node], node))

    def _event(self, kind: str, actor: str, **detail) -> None:
        self.events.append({"t": time.time(), "kind": kind, "actor": actor, **detail})
        del self.events[:-1000]

    def _persist(self) -> None:
        _kv_put({"epoch": self.epoch, "drained": sorted(self.drained)})

    def _publish(self) -> None:
        """Publish the current placement (minus drained replicas) as the routing table at the current epoch."""
        serving = {n: s for n, s in self.spec.actor_shards.items() if n not in self.drained}
        publish_table(self.epoch, serving, {n: asdict(self.slots[n]) for n in serving if n in self.slots})

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
        await asyncio.get_running_loop().run_in_executor(None, self._remap_lock.acquire)
        try:
            return await self._apply_placement(actor_shards, slots)
        finally:
            self._remap_lock.release()

    async def _apply_placement(self, actor_shards: dict[str, list], slots: dict[str, dict]) -> dict:
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
            handles[name] = self._spawn(new_slots[name], target_spec, 0)
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
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
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
        devices = cluster_devices(nodes, cfg.slots_per_gpu)
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
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[{"GPU": 1}] * count)
        self.requested_gpus = count
        self._event("request_resources", "-", gpus=count)

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
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
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
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
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
                     fresh: bool = True) -> ray.actor.ActorHandle:
    """Create (or find) the controller actor and start it watching. fresh=True clears a record left by an
    earlier deployment on this cluster."""
    if fresh:
        _kv_put({})
        clear_table()
    try:
        handle = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        handle = ray.remote(Controller).options(
            name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime="detached", max_restarts=-1,
            max_concurrency=64, num_cpus=0,
        ).remote(spec, list(slots), config or ControllerConfig())
    ray.get(handle.start.remote())
    return handle
