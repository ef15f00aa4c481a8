"""The controller's watch and restores, step by step: probe every expected actor, restore the lost ones (at their
normal share where a live node has room, else through stand-ins on the survivors: cluster/lost_restore.py), and move
displaced actors back when a node with room joins.

No Ray here: the world is reached through `ops` (cluster/ray_ops.py: RayActorOps; a fake in tests), placements
change through the Remapper (cluster/remap_flow.py), and the state is the controller's ReplicaRegistry and
ActivityLog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict

from .activity_log import ActivityLog
from .actor_slots import ActorSlot
from .controller_config import ControllerConfig
from .displacement import displace, move_back, return_groups, stand_in_placement
from .lost_restore import RestorePlan, plan_return
from .naming import stand_in_actor_name
from .node_loss import NodeWatchState, observe
from .remap_flow import Remapper
from .replica_registry import SILENT, ReplicaRegistry

log = logging.getLogger(__name__)

# How long a restore waits for Ray to release a lost actor's name by itself before it asks ops to release a holder
# that sits on a dead node: Ray usually releases it within a few hundred ms of the node's death.
NAME_GRACE_S = 1.0


class RestoreUnplaced(Exception):
    """A restore Ray placed on no node for controller.restore_unplaced_s: the share it was planned into is taken."""


class RestoreFlow:
    def __init__(self, registry: ReplicaRegistry, ops, history: ActivityLog, config: ControllerConfig,
                 remapper: Remapper):
        self.reg, self.ops, self.history, self.config, self.remapper = registry, ops, history, config, remapper
        self._returning = False
        self._last_return_check = float("-inf")
        self._nodes = NodeWatchState()

    async def check_all(self) -> None:
        """One pass of the watch: probe every expected actor not being restored; start restoring the lost ones."""
        reg = self.reg
        names = [n for n in reg.expected() if n not in reg.restoring]
        before = {n: reg.generations.get(n) for n in names}
        infos = await asyncio.gather(*(self.ops.probe(n, self.config.ping_timeout_s) for n in names))
        # The node watch may have found some of them lost (and restored them) while the probes ran: its verdict
        # is newer than a probe that timed out on the old incarnation.
        fresh = [(n, i) for n, i in zip(names, infos) if n not in reg.restoring and reg.generations.get(n) == before[n]]
        answers = dict(fresh)
        lost, to_restore = reg.probed(list(answers), list(answers.values()), restore=self.config.restore,
                                      misses=self.config.probe_misses)
        for name in lost:
            if answers[name] == SILENT:  # silent probe after probe: hung, not busy; free the name for its restore
                self.ops.kill_named(name)
                self.history.event("lost", name, reason="silent", probes=self.config.probe_misses)
            else:
                self.history.event("lost", name)
        if to_restore:
            asyncio.get_running_loop().create_task(self.restore_lost(to_restore))

    def node_check(self, snapshot: list[dict]) -> list[str]:
        """One poll of the node watch (cluster/node_loss.py): the actors on a node Ray now calls dead are lost at
        once, without waiting for their probes to time out, and restored together (one re-plan for the node).
        snapshot: `ray.nodes()`. -> the actors it started restoring."""
        reg = self.reg
        placed = {(n, reg.generations.get(n, 0)): reg.node_of(n) for n in reg.expected() if n not in reg.restoring}
        loss, self._nodes = observe(self._nodes, snapshot, placed)
        for node in loss.dead_nodes:
            self.history.event("node_lost", node, actors=sorted(n for (n, _), at in placed.items() if at == node))
        names = [name for name, _ in loss.lost if name not in reg.restoring]
        # An actor this controller has not seen answer yet is placed by its slot, which a restore under an earlier
        # controller may have moved: a controller recreated after a node loss read that node's old actors from the
        # published slots and restored actors already running elsewhere (8-node chaos drill: 9 restores refused
        # with "name already taken"). Ray's actor table says where the name's live holder runs.
        for name in [n for n in names if n not in reg.nodes]:
            node = self.ops.actor_node(name)
            if node is not None and node not in self._nodes.dead:
                reg.nodes[name] = node
                names.remove(name)
        if not names:
            return []
        lost, to_restore = reg.probed(names, [None] * len(names), restore=self.config.restore)
        for name in lost:
            self.history.event("lost", name, reason="node", node_id=reg.node_of(name))
        if to_restore:
            asyncio.get_running_loop().create_task(self.restore_lost(to_restore))
        return to_restore

    def return_due(self, now: float) -> bool:
        """Whether to look for room for the displaced actors now (then it counts as started). Not while a restore is
        under way: its remap and the return would each plan from a stale placement. now: time.monotonic()."""
        reg = self.reg
        if not reg.displaced or not self.config.restore or self._returning or reg.restoring \
                or now - self._last_return_check < self.config.return_check_s:
            return False
        self._last_return_check = now
        self._returning = True
        return True

    async def restore_lost(self, names: list[str]) -> None:
        """Bring back the actors one pass found lost: each at its normal share where a live node has room for it,
        the others through a re-plan onto the survivors (stand-ins, fewer replicas) while Ray's autoscaler is asked
        for the room."""
        # A remap that finished while this pass ran (a stand-in for a node lost at the same moment) may have retired
        # some of them: nobody routes to those any more, so there is nothing to bring back (CI chaos drill: planning
        # one raised KeyError and the whole batch, other actors' restores included, fell back to the blind path).
        retired = [n for n in names if n not in self.reg.spec.actor_shards]
        if retired:
            self.reg.restoring.difference_update(retired)
            self.reg.lost.difference_update(retired)
            names = [n for n in names if n not in retired]
            if not names:
                return
        claims = self.reg.claims
        with claims.planning():  # no claim from another thread (the elastic loop's remap) between read and claim
            try:
                # Free room net of what earlier plans placed but Ray does not count yet (cluster/placement_claims.py):
                # another pass's restores or a remap's new actors, still starting, must not be planned into twice.
                raw = self.ops.rooms()
                plan = self.reg.restore_plan(names, claims.net(raw), self.config.stand_in_min_cpus,
                                             stand_in_actor_name)
            except Exception:  # resource tables unreadable: restore as before, Ray places them where it can
                log.exception("restore re-plan failed")
                raw, plan = None, RestorePlan(full={n: self.reg.slot_of(n) for n in names})
            # Claimed before the first await, so a plan that runs while these start sees them.
            home = {n for n, s in plan.full.items() if s.node_id == self.reg.node_of(n)}  # in their own share
            claims.claim(plan.full.values(), raw, by="restore", reuse=home)
            claims.claim((s.slot for s in plan.stand_ins.values()), raw, by="stand_in")
        restores = [self.restore(n, plan.full[n]) for n in names if n in plan.full]
        if plan.displaced:
            restores.append(self.stand_in(plan))
        await asyncio.gather(*restores)

    async def restore(self, name: str, slot: ActorSlot | None = None) -> None:
        """Start `name` again under its own name. slot: where (its normal share on a node with room); None: its own
        slot."""
        reg, started, replan = self.reg, time.time(), False
        slot = slot or reg.slot_of(name)
        try:
            generation = reg.generations.get(name, 0) + 1
            handle = await self._spawn_when_name_free(name, slot, generation)
            try:
                info = await self._ready_unless_unplaced(name, handle)  # after warm-up
            except RestoreUnplaced as exc:
                # Planned into a share another actor holds (its own node's returned share, taken before this plan
                # read the table): Ray would keep it queued for restore_timeout_s. Plan it again by free room.
                self.ops.kill(handle)
                reg.home_taken.add(name)
                self.history.event("restore_unplaced", name, node_id=slot.node_id,
                                   seconds=round(time.time() - started, 3), error=str(exc))
                replan = True
                return
            if name not in reg.spec.actor_shards or name in reg.drained:
                # A remap retired (or an operator drained) it while it was coming back: nobody routes to it.
                reg.claims.release(name, "retired")
                self.ops.kill(handle)
                self.history.event("restore_dropped", name)
                return
            reg.claims.release(name, "alive")  # before the event: whoever sees "restored" sees no claim for it
            reg.seen(name, {**info, "generation": generation})
            reg.epoch += 1
            self.ops.persist()
            self.history.event("restored", name, seconds=round(time.time() - started, 3), node_id=info["node_id"],
                               generation=generation)
        except Exception as exc:
            self.history.event("restore_failed", name, error=f"{type(exc).__name__}: {exc}"[:500])
        finally:
            reg.claims.release(name, "failed")  # no-op once it ended above (or Ray's table showed it)
            if replan:  # still restoring: the watch must not start a second restore of it meanwhile
                asyncio.get_running_loop().create_task(self.restore_lost([name]))
            else:
                reg.restoring.discard(name)

    async def _ready_unless_unplaced(self, name: str, handle) -> dict:
        """ops.ready(handle), unless Ray leaves the actor on no node for restore_unplaced_s in a row (then raises
        RestoreUnplaced). Placed actors get restore_timeout_s to load and warm up."""
        limit = self.config.restore_unplaced_s
        ready = asyncio.ensure_future(self.ops.ready(handle, self.config.restore_timeout_s))
        unplaced_since = None
        try:
            while True:
                done, _ = await asyncio.wait({ready}, timeout=min(1.0, limit / 4))
                if done:
                    return ready.result()
                placed, now = self.ops.placed(name), time.monotonic()
                if placed is not False:  # placed, or Ray's table unreadable: wait on
                    unplaced_since = None
                elif unplaced_since is None:
                    unplaced_since = now
                elif now - unplaced_since >= limit:
                    raise RestoreUnplaced(f"on no node for {limit:g} s: no room for its share where it was planned")
        finally:
            if not ready.done():
                ready.cancel()

    async def _spawn_when_name_free(self, name: str, slot: ActorSlot, generation: int):
        """ops.spawn, tried again while Ray still holds the lost actor's name: the node watch can find an actor lost
        before Ray has processed its death (seen in the node drill: the restore refused with ActorAlreadyExistsError
        40 ms after the node was declared dead). Past NAME_GRACE_S the holder is released if it sits on a node
        that is no longer alive (ops.release_stale_name: Ray held three such names for 30 s and more in one CI run,
        so every restore pass failed). Up to ping_timeout_s; a later error, or one of another kind, raises."""
        start = time.monotonic()
        deadline, released = start + self.config.ping_timeout_s, False
        while True:
            try:
                return self.ops.spawn(slot, self.reg.spec, generation)
            except Exception as exc:
                # By name, so this module needs no Ray: ray.exceptions.ActorAlreadyExistsError.
                if type(exc).__name__ != "ActorAlreadyExistsError" or time.monotonic() >= deadline:
                    raise
            if not released and time.monotonic() - start >= NAME_GRACE_S:
                released = self.ops.release_stale_name(name)
                if released:
                    self.history.event("stale_name_released", name)
            await asyncio.sleep(0.1)

    async def stand_in(self, plan: RestorePlan) -> None:
        """Serve the lost shards the survivors have no room for as `plan` says: start its stand-ins, publish the
        placement without the displaced actors (live, like any remap), and ask for the normal shape."""
        reg, displaced = self.reg, plan.displaced
        self.history.event("restore_replanned", ",".join(displaced), reason=plan.reason, deferred=list(plan.deferred),
                           stand_ins={n: {"replaces": list(s.replaces), "node_id": s.slot.node_id,
                                          "num_cpus": s.slot.num_cpus, "num_gpus": s.slot.num_gpus}
                                      for n, s in plan.stand_ins.items()})
        reg.stand_in_serial += len(plan.stand_ins)
        try:
            # Record the displaced before the remap retires them (it forgets their slots).
            records = displace(reg.displaced, plan, reg.slots, reg.spec.actor_shards)
            reg.displaced.update(records)
            self.ops.persist()
            # Hard affinity: Ray would place a stand-in that reserves nothing on any node, not the one planned.
            stand_in_slots = {n: asdict(s.slot) for n, s in plan.stand_ins.items()}
            # The target from the placement as it stands once this remap runs: another pass's remap may be
            # retiring other actors meanwhile.
            result = await self.remapper.remap(lambda: stand_in_placement(reg.spec.actor_shards, reg.drained, plan),
                                               stand_in_slots, soft=False)
            if not result.get("ok"):
                for name in records:
                    reg.displaced.pop(name, None)
                self.ops.persist()
                return  # the next pass finds them lost again and re-plans
            for name in displaced:
                reg.lost.discard(name)
                reg.nodes.pop(name, None)  # gone: it no longer counts towards its node's load (choose_node)
            self.set_restore_request(list(plan.request))
        except Exception as exc:
            self.history.event("restore_failed", ",".join(displaced), error=f"{type(exc).__name__}: {exc}"[:500])
        finally:
            for name in plan.stand_ins:  # the remap ended them (alive or failed) unless it never started them
                reg.claims.release(name, "failed")
            reg.restoring.difference_update(displaced)

    async def return_displaced(self) -> None:
        """Displaced actors that fit at their normal share now (a node joined) start again under their own names;
        the stand-ins they had go (one live remap). With none displaced any more, the resource request goes."""
        reg, returning = self.reg, {}
        try:
            with reg.claims.planning():
                raw = self.ops.rooms()
                back = plan_return(return_groups(reg.displaced), reg.claims.net(raw), reg.live_nodes())
                if not back:
                    return
                move = move_back(back, reg.spec.actor_shards, reg.drained, reg.displaced)
                returning = move.returning
                reg.claims.claim(returning.values(), raw, by="return")
            result = await self.remapper.remap(move.placement, {n: asdict(s) for n, s in move.returning.items()})
            if not result.get("ok"):
                return
            for name in move.returning:
                reg.displaced.pop(name, None)
            self.history.event("moved_back", ",".join(sorted(move.returning)), retired=move.retiring,
                               epoch=result["epoch"])
            if not reg.displaced:
                self.set_restore_request([])
            self.ops.persist()
        except Exception:
            log.exception("moving displaced actors back failed")
        finally:
            for name in returning:  # the remap ended them (alive or failed) unless it never started them
                reg.claims.release(name, "failed")
            self._returning = False

    def set_restore_request(self, bundles: list[dict]) -> None:
        """Ask Ray's autoscaler for the displaced actors' normal shape ([]: release it) and the elastic loop's GPUs."""
        reg = self.reg
        if bundles == reg.restore_request:
            return
        reg.restore_request = bundles
        self.ops.request_resources()
        self.history.event("request_resources", "-", gpus=reg.requested_gpus, bundles=len(bundles),
                           reason="lost actors displaced" if bundles else "lost actors back at their normal share")
