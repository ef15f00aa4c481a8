"""Placements the controller has planned but Ray does not count yet: a ledger of claims on nodes' free room. Pure; no
Ray.

Every plan that puts actors on nodes (a restore, its stand-ins, a move back, a live remap's added actors) reads Ray's
free table (`available_resources_per_node`). Ray only subtracts an actor's share once it has scheduled it, and its
table reaches the controller a moment later; an actor that cannot be scheduled is never subtracted at all. So two plans
made close together (two restore passes, a restore and a remap) both saw the same free room and could each fill it:
the second actor then waits in Ray's queue as PENDING, or a stand-in is made that was not needed.

A claim is one planned actor's share on the node it was planned for. Plans read free room *net of live claims*
(`ClaimLedger.net`), so the second plan sees what the first took. A claim lives from the moment its plan is issued
until the first of:

  - Ray's table shows it (`reconcile`, on every read of the free table): the node's free room has fallen by the claim
    (plus the claims made before it on that node that the plan's snapshot did not show) since its plan read the
    table. From then on Ray counts the actor, and keeping the claim would count it twice;
  - the actor is seen alive (it answered after warm-up: `release`);
  - its creation failed (spawn raised, it did not warm up, its remap failed: `release`, at once);
  - it was retired or remapped away before it came up (`release`);
  - its deadline, `controller.claim_ttl_s` after it was made (`expire`): the safety net for the cases the others miss
    (Ray placed it on another node than planned, a drop in free room was masked by another actor dying on the node,
    a release path not taken). While a stale claim lives it makes its node look fuller than it is, and a plan may then
    make a stand-in that was not needed; the deadline bounds how long that can happen.

A lost actor restarting on the node it last ran on is planned there without checking free room (its dead share comes
back there); `net` also reports what claims of actors *new* to a node hold (NodeRoom.claimed_cpus), and while there
are any, the restart must fit in what is left like anywhere else: such a plan may have taken that returned share.

    ledger = ClaimLedger(ttl_s=10.0)
    with ledger.planning():                  # no other thread's claim between this read and this claim
        rooms = ledger.net(raw_rooms)        # expire + reconcile against raw_rooms, then subtract live claims
        plan = plan_restore(..., rooms, ...)
        ledger.claim(planned_slots, raw_rooms, by="restore", reuse=restarting_at_home)
    ...
    ledger.release(name, "alive")
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from .actor_slots import ActorSlot
from .lost_restore import NodeRoom

DEFAULT_CLAIM_TTL_S = 10.0  # ControllerConfig.claim_ttl_s's default (see there for why)
_EPS = 1e-9


@dataclass(frozen=True)
class Claim:
    """One planned actor's share on the node it was planned for."""

    name: str
    node_id: str
    cpus: float
    gpus: float
    made_at: float  # the ledger's clock (time.monotonic) when the plan was issued
    by: str  # which plan made it: restore | stand_in | return | remap
    # The node's free room (cpus, gpus) in the Ray table the plan read, and the claims on that node the plan saw
    # netted out of it (they were not in the table yet): the claim is in Ray's table once free room <= seen - ahead -
    # own share. None: the plan read no table (a remap given its slots): only release or the deadline end it.
    seen_free: tuple[float, float] | None = None
    ahead: tuple[float, float] = (0.0, 0.0)
    # The actor restarts on the node it last ran on, in the share its dead incarnation gave back: it takes no room
    # another lost actor's own share could be, so it does not stop their in-place restores (NodeRoom.claimed_cpus).
    reuses_share: bool = False


class ClaimLedger:
    """The live claims, by actor name (one per actor: a second claim for the same name keeps the first). Thread-safe:
    the controller's elastic loop remaps from its own thread and event loop while the watch restores on another."""

    def __init__(self, ttl_s: float = DEFAULT_CLAIM_TTL_S, clock: Callable[[], float] = time.monotonic):
        assert ttl_s > 0, "ttl_s must be > 0"
        self.ttl_s, self.clock = ttl_s, clock
        self._claims: dict[str, Claim] = {}
        self._lock = threading.RLock()
        self.ended: dict[str, int] = {}  # why claims ended, counted: alive, failed, retired, reflected, expired

    def planning(self) -> threading.RLock:
        """Hold it from reading the free table to claiming what was planned from it (`with ledger.planning():`), so
        a plan on another thread cannot claim in between and go unseen."""
        return self._lock

    def __len__(self) -> int:
        return len(self._claims)

    def __contains__(self, name: str) -> bool:
        return name in self._claims

    def claim(self, slots: Iterable[ActorSlot], rooms: Sequence[NodeRoom] | None, by: str,
              reuse: Collection[str] = ()) -> list[str]:
        """Claim each slot's share on its node. rooms: the raw free table (not netted) the plan read, or None when it
        read none; reuse: the names restarting on the node they last ran on. -> the names newly claimed (a name
        already claimed keeps its first claim; a slot that reserves nothing is not claimed)."""
        with self._lock:
            seen = {r.node_id: (r.free_cpus, r.free_gpus) for r in rooms} if rooms is not None else None
            now, made = self.clock(), []
            for slot in slots:
                if slot.name in self._claims or (slot.num_cpus <= 0 and slot.num_gpus <= 0):
                    continue  # an unreserved actor (a stand-in on a full node) takes nothing Ray counts
                ahead = self._claimed_on(slot.node_id)  # live claims there; the plan netted them from what it read
                free = seen.get(slot.node_id) if seen is not None else None
                self._claims[slot.name] = Claim(slot.name, slot.node_id, float(slot.num_cpus), float(slot.num_gpus),
                                                now, by, free, ahead, slot.name in reuse)
                made.append(slot.name)
            return made

    def release(self, name: str, reason: str) -> bool:
        """End `name`'s claim (reason: alive | failed | retired); False when it had none (already ended)."""
        with self._lock:
            if self._claims.pop(name, None) is None:
                return False
            self.ended[reason] = self.ended.get(reason, 0) + 1
            return True

    def expire(self) -> list[str]:
        """End the claims older than ttl_s. -> their names."""
        with self._lock:
            now = self.clock()
            old = sorted(n for n, c in self._claims.items() if now - c.made_at >= self.ttl_s)
            for name in old:
                self.release(name, "expired")
            return old

    def reconcile(self, rooms: Sequence[NodeRoom]) -> list[str]:
        """End the claims that the raw free table `rooms` shows: on their node, free room has fallen by their share
        and the unseen claims ahead of them since their plan read it. -> their names."""
        with self._lock:
            free = {r.node_id: (r.free_cpus, r.free_gpus) for r in rooms}
            shown = []
            for name, c in sorted(self._claims.items(), key=lambda kv: (kv[1].made_at, kv[0])):
                if c.seen_free is None or c.node_id not in free:
                    continue
                now_cpus, now_gpus = free[c.node_id]
                if now_cpus <= c.seen_free[0] - c.ahead[0] - c.cpus + _EPS and \
                        now_gpus <= c.seen_free[1] - c.ahead[1] - c.gpus + _EPS:
                    shown.append(name)
            for name in shown:
                self.release(name, "reflected")
            return shown

    def net(self, rooms: Sequence[NodeRoom]) -> list[NodeRoom]:
        """The free room a plan should read: `rooms` (the raw free table) after expiring and reconciling the claims,
        less every live claim on each node (may go below 0: a node is claimed past what Ray shows free), with what
        the claims of actors new to the node hold in claimed_cpus/claimed_gpus (a lost actor's own node is then no
        sure place for it)."""
        with self._lock:
            self.expire()
            self.reconcile(rooms)
            out = []
            for r in rooms:
                used, new = self._claimed_on(r.node_id), self._claimed_on(r.node_id, reused=False)
                out.append(replace(r, free_cpus=r.free_cpus - used[0], free_gpus=r.free_gpus - used[1],
                                   claimed_cpus=new[0], claimed_gpus=new[1]) if used != (0.0, 0.0) else r)
            return out

    def view(self) -> dict:
        """For the controller's state: {"live": count, "claims": [{name, node_id, cpus, gpus, by, age_s}], "ended":
        {reason: count}}."""
        with self._lock:
            now = self.clock()
            return {"live": len(self._claims),
                    "claims": [{"name": c.name, "node_id": c.node_id, "cpus": c.cpus, "gpus": c.gpus, "by": c.by,
                                "age_s": round(now - c.made_at, 3)} for c in sorted(self._claims.values(),
                                                                                     key=lambda c: c.name)],
                    "ended": dict(self.ended)}

    def _claimed_on(self, node_id: str, reused: bool | None = None) -> tuple[float, float]:
        """The claims on node_id (reused False: only those of actors new to it)."""
        mine = [c for c in self._claims.values()
                if c.node_id == node_id and (reused is None or c.reuses_share == reused)]
        return sum(c.cpus for c in mine), sum(c.gpus for c in mine)
