"""A live remap, step by step: start the actors a new placement adds and wait until each has loaded and warmed up,
then publish the table (routers switch between steps), then wait until every router routes with it, and only then
stop the actors it no longer names. No call ever goes to an actor that is not ready or already stopped, so no request
fails and, since every replica of a shard computes the same thing, no result changes.

No Ray here: the world is reached through `ops` (cluster/ray_ops.py: RayActorOps; a fake in tests), the state is the
controller's ReplicaRegistry, RouterReports and ActivityLog.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from .activity_log import ActivityLog
from .actor_slots import ActorSlot
from .controller_config import ControllerConfig
from .placement_change import placement_change
from .replica_registry import ReplicaRegistry
from .router_reports import RouterReports


class Remapper:
    def __init__(self, registry: ReplicaRegistry, ops, history: ActivityLog, routers: RouterReports,
                 config: ControllerConfig, clock: Callable[[], float] = time.time):
        self.reg, self.ops, self.history, self.routers, self.config = registry, ops, history, routers, config
        self.clock = clock
        self._lock = threading.Lock()  # one remap at a time, whichever thread's event loop asks

    def routers_behind(self, epoch: int) -> list[str]:
        """Live routers (heard from within router_ttl_s) that still route with an older table."""
        return self.routers.behind(epoch, self.clock(), self.config.router_ttl_s)

    async def remap(self, actor_shards: dict[str, list] | Callable[[], dict[str, list]], slots: dict[str, dict],
                    soft: bool = True) -> dict:
        """Controller.apply_placement, one at a time; soft False starts the added actors only on their slots' nodes.
        actor_shards: the target, or a function computing it from the registry once this remap holds the lock (a
        target read from the placement before another remap finished names actors that remap retired: CI chaos
        drill, two deferrals at one tick, "slots: no slot for new actors"). ValueError (naming the argument) when
        an actor would change shards or a new one has no slot."""
        await asyncio.get_running_loop().run_in_executor(None, self._lock.acquire)
        try:
            target = actor_shards() if callable(actor_shards) else actor_shards
            return await self._apply(target, slots, soft)
        finally:
            self._lock.release()

    async def _apply(self, actor_shards: dict[str, list], slots: dict[str, dict], soft: bool) -> dict:
        reg = self.reg
        target_spec = reg.spec.with_actor_shards(actor_shards)
        current = {n: s for n, s in reg.spec.actor_shards.items() if n not in reg.drained}
        change = placement_change(current, target_spec.actor_shards, slots)
        added, retired = change.added, change.retired
        started = self.clock()
        new_slots = {n: ActorSlot(**{**slots[n], "name": n}) for n in added}  # the key names the actor
        # Claimed (if the plan that chose these slots has not claimed them already) until Ray's free table shows
        # each, or it is up or failed, so a restore planned meanwhile does not put its actors into the same room
        # (cluster/placement_claims.py). The table read here is what the claims are later checked against.
        with reg.claims.planning():
            try:
                raw = self.ops.rooms()
                reg.claims.net(raw)  # end the claims this table already shows: the new ones count only the others
            except Exception:  # unreadable: the claims then end when the actors are up, fail, or at their deadline
                raw = None
            reg.claims.claim((new_slots[n] for n in added), raw, by="remap")
        handles = {}
        try:
            for name in added:
                reg.slots[name] = new_slots[name]
                handles[name] = self.ops.spawn(new_slots[name], target_spec, 0, soft)
        except Exception:  # Ray refused one: its claim, and those of the ones not started, must not linger
            for name in added:
                reg.claims.release(name, "failed")
            raise
        infos = await asyncio.gather(*(self.ops.ready(h, self.config.restore_timeout_s) for h in handles.values()),
                                     return_exceptions=True)
        failed = {n: i for n, i in zip(handles, infos) if isinstance(i, BaseException)}
        for name in added:
            reg.claims.release(name, "failed" if failed else "alive")  # a failed remap kills every one it started
        if failed:
            for name, handle in handles.items():
                self.ops.kill(handle)
                reg.slots.pop(name, None)
            self.history.event("remap_failed", ",".join(sorted(failed)), error=repr(next(iter(failed.values())))[:500])
            return {"ok": False, "epoch": reg.epoch, "failed": sorted(failed)}
        for name, info in zip(handles, infos):
            reg.seen(name, info)
        reg.spec = target_spec
        reg.drained -= set(retired)
        reg.epoch += 1
        epoch = reg.epoch
        self.ops.publish()
        self.ops.persist()
        ready_s = round(self.clock() - started, 3)
        self.history.event("remap", ",".join(added) or "-", epoch=epoch, added=added, retired=retired, ready_s=ready_s)
        deadline = self.clock() + self.config.drain_timeout_s
        while self.routers_behind(epoch) and self.clock() < deadline:
            await asyncio.sleep(0.1)
        behind = self.routers_behind(epoch)
        for name in retired:
            self.ops.kill_named(name)
            reg.slots.pop(name, None)
            reg.claims.release(name, "retired")  # an actor still starting for a restore when this retired it
            self.history.event("retired", name, epoch=epoch)
        return {"ok": True, "epoch": epoch, "added": added, "retired": retired, "ready_s": ready_s,
                "switch_s": round(self.clock() - started - ready_s, 3), "routers_behind": behind}
