"""The controller's flows with the placement ledger (cluster/placement_claims.py), against the fake `ops` of
test_controller_flows: plans made while earlier plans' actors are still starting (Ray's free table does not show them
yet: the fake's table never changes unless a test changes it) do not put two actors into room for one, and claims
that go stale or whose actor failed stop counting."""

from __future__ import annotations

import asyncio

from expertmesh.cluster.activity_log import ActivityLog
from expertmesh.cluster.actor_slots import ActorSlot
from expertmesh.cluster.controller_config import ControllerConfig
from expertmesh.cluster.lost_restore import NodeRoom
from expertmesh.cluster.placement_claims import ClaimLedger
from expertmesh.cluster.pool_spec import PoolSpec
from expertmesh.cluster.remap_flow import Remapper
from expertmesh.cluster.replica_registry import ReplicaRegistry
from expertmesh.cluster.restore_flow import RestoreFlow
from expertmesh.cluster.router_reports import RouterReports
from tests.controller_fakes import FakeOps, kinds

PLACEMENT = {"expert-e0-r0": [[0, 0]], "expert-e1-r0": [[0, 1]], "expert-e2-r0": [[0, 2]]}
NODES = {"expert-e0-r0": "a", "expert-e1-r0": "dead", "expert-e2-r0": "dead"}  # e1 and e2 were on the lost node


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class GatedOps(FakeOps):
    """FakeOps whose actors named in `held` stay starting (not ready) until `gate` is set."""

    def __init__(self, alive: set[str], rooms: list[NodeRoom]):
        super().__init__(alive, rooms)
        self.held: set[str] = set()
        self.gate = asyncio.Event()

    async def ready(self, handle: str, timeout_s: float) -> dict:
        if handle in self.held:
            await self.gate.wait()
        return await super().ready(handle, timeout_s)


def setup(rooms: list[NodeRoom], ttl_s: float = 10.0, unplaced_s: float = 15.0):
    spec = PoolSpec("m", "float32", {}).with_actor_shards(PLACEMENT)
    clock = Clock()
    reg = ReplicaRegistry(spec, {n: ActorSlot(n, NODES[n], 1.0, 0.0, None) for n in PLACEMENT},
                          claims=ClaimLedger(ttl_s, clock=clock))
    ops = GatedOps({"expert-e0-r0"}, rooms)
    history, routers = ActivityLog(), RouterReports()
    config = ControllerConfig(drain_timeout_s=0.3, claim_ttl_s=ttl_s, restore_unplaced_s=unplaced_s)
    remapper = Remapper(reg, ops, history, routers, config)
    for name in ("expert-e1-r0", "expert-e2-r0"):
        reg.lost.add(name)
        reg.restoring.add(name)
    return reg, ops, history, remapper, RestoreFlow(reg, ops, history, config, remapper), clock


def spawned_cpus(ops: FakeOps) -> dict[str, float]:
    """node -> CPUs of the 1-CPU actors started there at their full share."""
    out: dict[str, float] = {}
    for entry in ops.log:
        if entry[0] == "spawn" and not entry[1].startswith("expert-s"):
            out[entry[2]] = out.get(entry[2], 0.0) + 1.0
    return out


async def until(condition, tries: int = 100) -> None:
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_two_restore_passes_in_a_row_do_not_put_two_actors_into_room_for_one():
    rooms = [NodeRoom("a", 1.0), NodeRoom("b", 1.0)]  # room for one actor on each
    reg, ops, history, _, flow, _ = setup(rooms)
    ops.held = {"expert-e1-r0", "expert-e2-r0"}

    async def run():
        first = asyncio.create_task(flow.restore_lost(["expert-e1-r0"]))
        await until(lambda: any(e[:2] == ("spawn", "expert-e1-r0") for e in ops.log))
        assert len(reg.claims) == 1  # planned, starting, not in Ray's table yet
        second = asyncio.create_task(flow.restore_lost(["expert-e2-r0"]))  # the same table: a still shows 1.0
        await until(lambda: any(e[:2] == ("spawn", "expert-e2-r0") for e in ops.log))
        assert len(reg.claims) == 2
        ops.gate.set()
        await asyncio.gather(first, second)

    asyncio.run(run())
    assert spawned_cpus(ops) == {"a": 1.0, "b": 1.0}  # without the ledger both went to a (most free, then by id)
    assert kinds(history) == ["restored", "restored"] and len(reg.claims) == 0
    assert reg.claims.ended == {"alive": 2}


def test_a_restore_planned_while_a_remap_starts_its_actor_does_not_take_the_same_room():
    rooms = [NodeRoom("a", 1.0), NodeRoom("b", 1.0)]
    reg, ops, history, remapper, flow, _ = setup(rooms)
    reg.lost.discard("expert-e2-r0")
    reg.restoring.discard("expert-e2-r0")
    ops.alive.add("expert-e2-r0")
    ops.held = {"expert-e0-r1"}
    added = {"expert-e0-r1": {"node_id": "a", "num_cpus": 1.0, "num_gpus": 0.0, "gpu_slot": None}}

    async def run():
        remap = asyncio.create_task(remapper.remap({**PLACEMENT, "expert-e0-r1": [[0, 0]]}, added))
        await until(lambda: any(e[:2] == ("spawn", "expert-e0-r1") for e in ops.log))
        assert [c["by"] for c in reg.claims.view()["claims"]] == ["remap"]
        await flow.restore_lost(["expert-e1-r0"])
        ops.gate.set()
        return await remap

    result = asyncio.run(run())
    assert result["ok"] and ("spawn", "expert-e1-r0", "b", 1, True) in ops.log  # not onto a, the remap's room
    assert spawned_cpus(ops) == {"a": 1.0, "b": 1.0} and len(reg.claims) == 0


def test_a_stale_claim_expires_and_causes_no_stand_in():
    """A claim Ray's table never showed (its actor landed elsewhere) holds its node's room only until claim_ttl_s."""
    for age, stand_in in ((9.0, True), (10.0, False)):
        reg, ops, history, _, flow, clock = setup([NodeRoom("a", 1.0)], ttl_s=10.0)
        reg.claims.claim([ActorSlot("elsewhere", "a", 1.0, 0.0, None)], None, by="remap")
        clock.now += age
        asyncio.run(flow.restore_lost(["expert-e1-r0"]))
        assert ("restore_replanned" in kinds(history)) == stand_in, age  # a live claim leaves no room on a
        if not stand_in:
            assert ("spawn", "expert-e1-r0", "a", 1, True) in ops.log and reg.claims.ended["expired"] == 1


def test_a_claim_the_free_table_shows_stops_counting_so_the_room_is_not_counted_twice():
    reg, ops, history, _, flow, _ = setup([NodeRoom("a", 2.0)])
    ops.held = {"expert-e1-r0", "expert-e2-r0"}

    async def run():
        first = asyncio.create_task(flow.restore_lost(["expert-e1-r0"]))
        await until(lambda: len(ops.log) > 0)
        ops.room_list = [NodeRoom("a", 1.0)]  # Ray scheduled it: its share is in the table now
        second = asyncio.create_task(flow.restore_lost(["expert-e2-r0"]))
        await until(lambda: any(e[:2] == ("spawn", "expert-e2-r0") for e in ops.log))
        ops.gate.set()
        await asyncio.gather(first, second)

    asyncio.run(run())
    assert "restore_replanned" not in kinds(history)  # the 1.0 left on a was real: no stand-in
    assert spawned_cpus(ops) == {"a": 2.0} and reg.claims.ended == {"reflected": 1, "alive": 1}


def test_a_failed_creation_releases_its_claim_at_once():
    reg, ops, history, _, flow, clock = setup([NodeRoom("a", 1.0)])
    ops.broken.add("expert-e1-r0")
    asyncio.run(flow.restore_lost(["expert-e1-r0"]))
    assert kinds(history) == ["restore_failed"] and len(reg.claims) == 0 and reg.claims.ended == {"failed": 1}
    asyncio.run(flow.restore_lost(["expert-e2-r0"]))  # the same instant: the room is free again
    assert ("spawn", "expert-e2-r0", "a", 1, True) in ops.log and "restore_replanned" not in kinds(history)
    assert clock.now == 0.0


def test_a_spawn_ray_refuses_and_a_failed_stand_in_remap_release_their_claims():
    reg, ops, history, _, flow, _ = setup([NodeRoom("a", 0.5)])

    def refuse(*args, **kwargs):
        raise RuntimeError("no such node")

    spawn, ops.spawn = ops.spawn, refuse
    asyncio.run(flow.restore_lost(["expert-e1-r0"]))  # a stand-in on a (0.5 CPU); its remap's spawn raises
    assert "restore_failed" in kinds(history) and len(reg.claims) == 0
    ops.spawn = spawn
    ops.broken.add("expert-s1")
    reg.restoring.add("expert-e1-r0")
    asyncio.run(flow.restore_lost(["expert-e1-r0"]))  # the next stand-in does not warm up: its remap fails
    assert "remap_failed" in kinds(history) and len(reg.claims) == 0


def test_the_moved_back_actors_are_claimed_until_they_are_up():
    reg, ops, history, remapper, flow, _ = setup([NodeRoom("a", 0.5)])
    asyncio.run(flow.restore_lost(["expert-e1-r0"]))  # no room: a stand-in, e1 displaced
    assert reg.displaced and len(reg.claims) == 0
    ops.room_list = [NodeRoom("a", 0.0), NodeRoom("c", 1.0)]  # a node with room for it joined
    ops.held = {"expert-e1-r0"}
    reg.restoring.clear()

    async def run():
        back = asyncio.create_task(flow.return_displaced())
        await until(lambda: any(e[:2] == ("spawn", "expert-e1-r0") for e in ops.log))
        assert [(c["name"], c["node_id"], c["by"]) for c in reg.claims.view()["claims"]] == \
            [("expert-e1-r0", "c", "return")]
        ops.gate.set()
        await back

    asyncio.run(run())
    assert "moved_back" in kinds(history) and len(reg.claims) == 0


def test_an_in_place_restore_does_not_go_home_when_another_plan_took_its_returned_share():
    """The CI chaos drill's known gap: a node's re-plan put a lost actor into the share another actor's death gave
    back on a survivor; that actor's in-place restore (its own node: a share assumed to come back) then waited
    PENDING. Its own node holds a claim now, so it must fit there by what is left, like anywhere else."""
    rooms = [NodeRoom("a", 1.0), NodeRoom("b", 1.0)]  # a: e0-r0's share, free since it was killed
    reg, ops, history, _, flow, _ = setup(rooms)
    reg.nodes["expert-e0-r0"] = "a"
    ops.held = {"expert-e1-r0", "expert-e0-r0"}

    async def run():
        node_plan = asyncio.create_task(flow.restore_lost(["expert-e1-r0"]))  # the node watch's re-plan: onto a
        await until(lambda: any(e[:2] == ("spawn", "expert-e1-r0") for e in ops.log))
        reg.lost.add("expert-e0-r0")
        reg.restoring.add("expert-e0-r0")
        in_place = asyncio.create_task(flow.restore_lost(["expert-e0-r0"]))  # the probe pass finds e0-r0 gone
        await until(lambda: any(e[:2] == ("spawn", "expert-e0-r0") for e in ops.log))
        ops.gate.set()
        await asyncio.gather(node_plan, in_place)

    asyncio.run(run())
    assert ("spawn", "expert-e1-r0", "a", 1, True) in ops.log
    assert ("spawn", "expert-e0-r0", "b", 1, True) in ops.log  # without the claim check: home, a, oversubscribed


def test_two_in_place_restores_on_one_node_both_go_home():
    """Claims of actors restarting in their own returned share do not take another's: both still restart at home,
    even though the free table (not caught up) shows no room there."""
    reg, ops, history, _, flow, _ = setup([NodeRoom("a", 0.0)])
    for name in ("expert-e1-r0", "expert-e2-r0"):
        reg.nodes[name] = "a"  # killed in place on a, found by two passes
    ops.held = {"expert-e1-r0", "expert-e2-r0"}

    async def run():
        first = asyncio.create_task(flow.restore_lost(["expert-e1-r0"]))
        await until(lambda: any(e[:2] == ("spawn", "expert-e1-r0") for e in ops.log))
        second = asyncio.create_task(flow.restore_lost(["expert-e2-r0"]))
        await until(lambda: any(e[:2] == ("spawn", "expert-e2-r0") for e in ops.log))
        assert [c["by"] for c in reg.claims.view()["claims"]] == ["restore", "restore"]
        ops.gate.set()
        await asyncio.gather(first, second)

    asyncio.run(run())
    assert spawned_cpus(ops) == {"a": 2.0} and "restore_replanned" not in kinds(history)


def test_a_remaps_claim_ends_when_the_free_table_shows_its_actor_still_loading():
    reg, ops, history, remapper, flow, _ = setup([NodeRoom("a", 2.0)])
    ops.held = {"expert-e0-r1"}
    added = {"expert-e0-r1": {"node_id": "a", "num_cpus": 1.0, "num_gpus": 0.0, "gpu_slot": None}}

    async def run():
        remap = asyncio.create_task(remapper.remap({**PLACEMENT, "expert-e0-r1": [[0, 0]]}, added))
        await until(lambda: any(e[:2] == ("spawn", "expert-e0-r1") for e in ops.log))
        ops.room_list = [NodeRoom("a", 1.0)]  # Ray scheduled it; it is still loading its weights
        await flow.restore_lost(["expert-e1-r0"])  # the 1.0 left is real: restored there, no stand-in
        ops.gate.set()
        return await remap

    assert asyncio.run(run())["ok"]
    assert ("spawn", "expert-e1-r0", "a", 1, True) in ops.log and "restore_replanned" not in kinds(history)
    assert reg.claims.ended == {"reflected": 1, "alive": 1}


def test_a_restore_ray_leaves_on_no_node_is_killed_and_planned_again_by_free_room():
    """The CI chaos drill's failure: e0-r0 was killed on a, another plan's actor (now up, its claim ended) took the
    share it gave back, and e0-r0's restart at home waited in Ray's queue (restore_timeout_s: 30 min). After
    restore_unplaced_s on no node it is killed and planned again by free room: none anywhere, so a stand-in."""
    reg, ops, history, _, flow, _ = setup([NodeRoom("a", 0.0), NodeRoom("b", 0.0)], unplaced_s=0.1)
    reg.nodes["expert-e0-r0"] = "a"
    for name in ("expert-e1-r0", "expert-e2-r0"):  # up again elsewhere; only e0-r0 is lost
        reg.lost.discard(name)
        reg.restoring.discard(name)
        reg.nodes[name] = "b"
        ops.alive.add(name)
    reg.lost.add("expert-e0-r0")
    reg.restoring.add("expert-e0-r0")
    ops.unplaced.add("expert-e0-r0")

    async def run():
        await flow.restore_lost(["expert-e0-r0"])
        await until(lambda: "remap" in kinds(history), tries=300)

    asyncio.run(run())
    assert ops.log[0] == ("spawn", "expert-e0-r0", "a", 1, True) and ("kill", "expert-e0-r0") in ops.log
    unplaced = next(e for e in history.events if e["kind"] == "restore_unplaced")
    assert unplaced["actor"] == "expert-e0-r0" and unplaced["node_id"] == "a"
    assert unplaced["seconds"] >= 0.1
    assert kinds(history)[:2] == ["restore_unplaced", "restore_replanned"]
    assert "expert-e0-r0" in reg.displaced and not reg.restoring and len(reg.claims) == 0
    assert sum(1 for e in ops.log if e[:2] == ("spawn", "expert-e0-r0")) == 1  # not sent home a second time


def test_a_restore_on_a_node_loading_longer_than_the_unplaced_limit_is_left_to_load():
    reg, ops, history, _, flow, _ = setup([NodeRoom("a", 1.0)], unplaced_s=0.05)
    ops.held = {"expert-e1-r0"}  # placed (the fake says so), still loading its weights
    reg.home_taken.add("expert-e1-r0")

    async def run():
        restore = asyncio.create_task(flow.restore_lost(["expert-e1-r0"]))
        await asyncio.sleep(0.3)
        ops.gate.set()
        await restore

    asyncio.run(run())
    assert kinds(history) == ["restored"] and ("kill", "expert-e1-r0") not in ops.log
    assert not reg.home_taken  # it answered: its home is its own again
