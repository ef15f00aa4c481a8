"""The controller's flows without Ray (cluster/restore_flow.py, cluster/remap_flow.py, cluster/control_pass.py): the
watch, restores, stand-ins and live remaps run against a fake `ops` that records what they would do to the world."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from expertmesh.cluster.actor_slots import ActorSlot
from expertmesh.cluster.control_pass import control_pass
from expertmesh.cluster.elastic import ElasticConfig, ElasticState
from expertmesh.cluster.lost_restore import NodeRoom
from expertmesh.cluster.pool_spec import PoolSpec
from expertmesh.cluster.replica_registry import ReplicaRegistry
from expertmesh.cluster.router_gpus import NO_RESERVATION
from expertmesh.experts.errors import ConfigError
from expertmesh.router_service.config import MeshConfig
from tests.controller_fakes import kinds, settle, settle_until, setup


def test_a_lost_actor_with_room_comes_back_under_its_name_at_the_next_generation():
    reg, ops, history, _, _, flow = setup([NodeRoom("a", 2.0)])
    ops.alive.discard("expert-e1-r0")

    async def run():
        await flow.check_all()
        assert reg.restoring == {"expert-e1-r0"} and reg.down() == {"expert-e1-r0"}
        await settle()

    asyncio.run(run())
    assert kinds(history) == ["lost", "restored"]
    assert ("spawn", "expert-e1-r0", "a", 1, True) in ops.log
    assert reg.generations["expert-e1-r0"] == 1 and reg.epoch == 1 and not reg.restoring and not reg.lost
    assert ops.log[-1] == ("persist",)


def test_a_busy_actor_is_left_alone_for_one_silent_probe_and_killed_and_restored_after_two():
    reg, ops, history, _, _, flow = setup([NodeRoom("a", 2.0)])
    assert flow.config.probe_misses == 2
    ops.silent.add("expert-e1-r0")

    async def run():
        await flow.check_all()  # one slow answer: a busy actor, not a dead one
        assert not reg.restoring and not reg.lost and ("kill", "expert-e1-r0") not in ops.log
        await flow.check_all()  # the second in a row: hung; its name is freed for the restore
        assert reg.restoring == {"expert-e1-r0"}
        await settle()

    asyncio.run(run())
    assert ("kill", "expert-e1-r0") in ops.log
    assert ops.log.index(("kill", "expert-e1-r0")) < next(i for i, e in enumerate(ops.log) if e[0] == "spawn")
    assert kinds(history) == ["lost", "restored"] and history.events[0]["reason"] == "silent"
    assert reg.generations["expert-e1-r0"] == 1 and not reg.lost


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_probe_misses_must_be_a_whole_number_of_at_least_one(value):
    with pytest.raises(ConfigError, match=r"controller\.probe_misses"):
        MeshConfig.from_dict({"controller": {"probe_misses": value}}).validate()


def test_a_restore_finishing_after_a_drain_is_dropped():
    reg, ops, history, _, _, flow = setup([NodeRoom("a", 2.0)])
    reg.restoring.add("expert-e1-r0")

    async def run():
        task = asyncio.create_task(flow.restore("expert-e1-r0"))
        reg.drained.add("expert-e1-r0")  # an operator drained it while it was starting
        await task

    asyncio.run(run())
    assert kinds(history) == ["restore_dropped"] and ("kill", "expert-e1-r0") in ops.log and reg.epoch == 0


def test_a_batch_with_an_actor_a_remap_retired_meanwhile_restores_the_others_and_skips_it():
    """CI chaos drill: a stand-in remap retired a lost actor while a restore pass held its name; planning it raised
    KeyError and the whole batch fell back to the blind path. It is skipped now; the others are restored."""
    reg, ops, history, _, _, flow = setup([NodeRoom("a", 4.0)])
    reg.lost |= {"expert-e0-r1", "expert-e1-r0"}
    reg.restoring |= {"expert-e0-r1", "expert-e1-r0"}
    reg.spec = reg.spec.with_actor_shards({"expert-e0-r0": [[0, 0]], "expert-e1-r0": [[0, 1]]})  # e0-r1 retired

    asyncio.run(flow.restore_lost(["expert-e0-r1", "expert-e1-r0"]))
    assert kinds(history) == ["restored"] and [e["actor"] for e in history.events] == ["expert-e1-r0"]
    assert not any(entry[:2] == ("spawn", "expert-e0-r1") for entry in ops.log)
    assert not reg.restoring and "expert-e0-r1" not in reg.lost


def test_with_no_room_the_lost_actor_gets_a_stand_in_published_live_and_the_normal_shape_is_asked_for():
    reg, ops, history, routers, _, flow = setup([NodeRoom("a", 0.5)])
    routers.ack("router-1", 1, now=1e18)  # switches at once (acks an epoch ahead)
    reg.lost.add("expert-e1-r0")
    reg.restoring.add("expert-e1-r0")
    asyncio.run(flow.restore_lost(["expert-e1-r0"]))
    assert "expert-s0" in reg.spec.actor_shards and "expert-e1-r0" not in reg.spec.actor_shards
    assert reg.displaced["expert-e1-r0"]["by"] == "expert-s0" and reg.stand_in_serial == 1
    assert reg.restore_request == [{"CPU": 1.0}] * 3 and ("request",) in ops.log  # the pool's normal shape
    assert ("spawn", "expert-s0", "a", 0, False) in ops.log  # hard affinity: only the node planned
    assert not reg.restoring and "expert-e1-r0" not in reg.lost
    assert "restore_replanned" in kinds(history) and "remap" in kinds(history)
    assert reg.table()[2] == []  # its stand-in replaced it; it is not "gone" any more, only displaced


def test_a_failed_stand_in_remap_forgets_the_displaced_records_and_the_next_pass_retries():
    reg, ops, history, _, _, flow = setup([NodeRoom("a", 0.5)])
    ops.broken.add("expert-s0")
    reg.lost.add("expert-e1-r0")
    reg.restoring.add("expert-e1-r0")
    asyncio.run(flow.restore_lost(["expert-e1-r0"]))
    assert reg.displaced == {} and "expert-e1-r0" in reg.spec.actor_shards and "expert-s0" not in reg.slots
    assert reg.epoch == 0 and not reg.restoring and "expert-e1-r0" in reg.lost
    assert ("kill", "expert-s0") in ops.log and "remap_failed" in kinds(history)


def test_moving_back_is_due_only_with_displaced_actors_no_restore_running_and_the_interval_passed():
    reg, _, _, _, _, flow = setup([])
    assert not flow.return_due(now=10.0)  # nothing displaced
    reg.displaced["expert-e1-r0"] = {"slot": {}, "shards": [], "by": None}
    reg.restoring.add("expert-e0-r0")
    assert not flow.return_due(now=10.0)
    reg.restoring.clear()
    assert flow.return_due(now=10.0)
    assert not flow.return_due(now=20.0)  # one at a time: the first has not finished


def test_a_displaced_actor_moves_back_and_its_stand_in_retires_when_a_node_joins():
    reg, ops, history, routers, _, flow = setup([NodeRoom("a", 0.5)])
    routers.ack("router-1", 10**6, now=1e18)
    reg.lost.add("expert-e1-r0")
    reg.restoring.add("expert-e1-r0")
    asyncio.run(flow.restore_lost(["expert-e1-r0"]))
    ops.room_list = [NodeRoom("a", 0.0), NodeRoom("c", 4.0)]  # a node with room joined
    assert flow.return_due(now=100.0)  # displaced, no restore running
    asyncio.run(flow.return_displaced())
    assert sorted(reg.spec.actor_shards) == ["expert-e0-r0", "expert-e0-r1", "expert-e1-r0"]
    assert reg.displaced == {} and reg.restore_request == [] and reg.slots["expert-e1-r0"].node_id == "c"
    assert ("kill", "expert-s0") in ops.log and kinds(history)[-2:] == ["moved_back", "request_resources"]
    assert not flow._returning  # finished: a later pass may look again


def test_a_remap_retires_old_actors_only_after_every_live_router_switched():
    reg, ops, history, routers, remapper, _ = setup([])
    routers.ack("slow-router", 0, now=1e18)  # never switches: the remap waits drain_timeout_s, then goes ahead
    placement = {"expert-e0-r1": [[0, 0]], "expert-e1-r0": [[0, 1]], "expert-e0-r2": [[0, 0]]}
    result = asyncio.run(remapper.remap(placement, {"expert-e0-r2": {"node_id": "b", "num_cpus": 1.0,
                                                                     "num_gpus": 0.0, "gpu_slot": None}}))
    assert result["ok"] and result["added"] == ["expert-e0-r2"] and result["retired"] == ["expert-e0-r0"]
    assert result["routers_behind"] == ["slow-router"] and result["switch_s"] >= 0.3
    order = [entry[0] for entry in ops.log]
    assert order == ["spawn", "publish", "persist", "kill"]  # started, published, and only then stopped
    assert reg.epoch == 1 and "expert-e0-r0" not in reg.slots and kinds(history) == ["remap", "retired"]


def test_control_pass_waits_while_an_actor_is_being_restored_and_balances_otherwise():
    placement = {"expert-e0-r0": [[0, 0], [0, 1]], "expert-e1-r0": [[0, 2], [0, 3]]}
    spec = PoolSpec("m", "float32", {}).with_actor_shards(placement)
    reg = ReplicaRegistry(spec, {"expert-e0-r0": ActorSlot("expert-e0-r0", "n0", 1.0, 0.0, None),
                                 "expert-e1-r0": ActorSlot("expert-e1-r0", "n1", 1.0, 0.0, None)})
    snapshot = {"layers": [0], "num_experts": 4, "counts": {"shard_load": [[100.0, 100.0, 100.0, 100.0]]}}
    alive = [{"NodeID": "n0", "Alive": True, "Resources": {"CPU": 2.0}},
             {"NodeID": "n1", "Alive": True, "Resources": {"CPU": 2.0}}]
    config = ElasticConfig(slots_per_gpu=4)
    reg.restoring.add("expert-e1-r0")
    waiting, state = control_pass(0.0, snapshot, alive, NO_RESERVATION, reg, ElasticState(), config)
    assert waiting.entry == {"reason": "expert-e1-r0 is not placed on a live device yet (failover first)"}
    assert waiting.placement is None and state == ElasticState()
    reg.restoring.clear()
    balanced, _ = control_pass(0.0, snapshot, alive, NO_RESERVATION, reg, ElasticState(), config)
    assert balanced.entry["reason"] in ("balanced", "little load") and balanced.placement is None
    assert np.isclose(balanced.entry["window_slots"], 400.0)


def test_a_dead_node_in_rays_table_restores_its_actors_at_once_in_one_replan_and_probes_do_not_restore_twice():
    placement = {"expert-e0-r0": [[0, 0]], "expert-e0-r1": [[0, 0]], "expert-e1-r0": [[0, 1]], "expert-e2-r0": [[0, 2]]}
    reg, ops, history, _, _, flow = setup([NodeRoom("a", 4.0)], placement)
    reg.slots["expert-e2-r0"] = ActorSlot("expert-e2-r0", "dead", 1.0, 0.0, None)  # two actors on the lost node
    plans = []
    real_plan = reg.restore_plan
    reg.restore_plan = lambda names, *rest: plans.append(list(names)) or real_plan(names, *rest)
    table = [{"NodeID": n, "Alive": True} for n in ("a", "b", "dead")]
    quick_probe = ops.probe

    async def slow_probe(name, timeout_s):  # a probe of an actor on a dead node waits (here: past its restore)
        answer = await quick_probe(name, timeout_s)
        await asyncio.sleep(0.05)
        return answer

    ops.probe = slow_probe

    async def run():
        assert flow.node_check(table) == []
        ops.alive -= {"expert-e1-r0", "expert-e2-r0"}
        table[2] = {"NodeID": "dead", "Alive": False}
        probing = asyncio.create_task(flow.check_all())  # a pass whose probes started before the watch saw it
        await asyncio.sleep(0)
        assert flow.node_check(table) == ["expert-e1-r0", "expert-e2-r0"]
        assert reg.restoring == {"expert-e1-r0", "expert-e2-r0"}
        await probing
        await settle()
        assert flow.node_check(table) == [], "a node is lost once; the restored actors run elsewhere"

    asyncio.run(run())
    assert plans == [["expert-e1-r0", "expert-e2-r0"]], "one re-plan for the node, none from the pass's probes"
    assert [e["kind"] for e in history.events] == ["node_lost", "lost", "lost", "restored", "restored"]
    assert history.events[0]["actors"] == ["expert-e1-r0", "expert-e2-r0"]
    assert sum(1 for entry in ops.log if entry[0] == "spawn") == 2 and not reg.restoring and not reg.lost


def test_a_recreated_controller_does_not_restore_actors_a_dead_node_had_that_already_run_elsewhere():
    """8-node chaos drill: a controller recreated after a node loss placed the node's old actors by their published
    slots (the dead node), though an earlier controller had restored them elsewhere, and tried to restore them again
    (refused: the names were taken). Ray's actor table, asked for actors this controller has not seen, settles it."""
    placement = {"expert-e0-r0": [[0, 0]], "expert-e0-r1": [[0, 0]], "expert-e1-r0": [[0, 1]], "expert-e2-r0": [[0, 2]]}
    reg, ops, history, _, _, flow = setup([NodeRoom("a", 4.0)], placement)
    reg.slots["expert-e2-r0"] = ActorSlot("expert-e2-r0", "dead", 1.0, 0.0, None)  # both slots name the dead node
    ops.holders["expert-e1-r0"] = "b"  # restored on b under the previous controller, alive
    ops.alive.discard("expert-e2-r0")  # really lost with its node
    table = [{"NodeID": "a", "Alive": True}, {"NodeID": "b", "Alive": True}, {"NodeID": "dead", "Alive": False}]

    async def run():
        assert flow.node_check(table) == ["expert-e2-r0"]
        await settle()
        assert flow.node_check(table) == []

    asyncio.run(run())
    assert reg.nodes["expert-e1-r0"] == "b" and "expert-e1-r0" not in reg.lost
    spawned = [entry[1] for entry in ops.log if entry[0] == "spawn"]
    assert spawned == ["expert-e2-r0"]
    assert [e["kind"] for e in history.events] == ["node_lost", "lost", "restored"]


def test_a_name_ray_keeps_holding_is_released_from_the_dead_node_and_the_restore_goes_on():
    """Ray held three lost actors' names for 30 s and more after their node died (a CI run): past the grace the
    restore asks ops to release a holder on a dead node, once, and then starts the replacement."""
    import expertmesh.cluster.restore_flow as restore_flow_module

    reg, ops, history, _, _, flow = setup([NodeRoom("a", 2.0)])
    ops.alive.discard("expert-e1-r0")
    ops.stale_names.add("expert-e1-r0")

    class ActorAlreadyExistsError(ValueError):
        pass

    spawn = ops.spawn

    def held_until_released(slot, spec, generation, soft=True):
        if slot.name in ops.stale_names:
            raise ActorAlreadyExistsError(f"{slot.name} is already taken")
        return spawn(slot, spec, generation, soft)

    ops.spawn = held_until_released
    grace, restore_flow_module.NAME_GRACE_S = restore_flow_module.NAME_GRACE_S, 0.2

    async def run():
        await flow.check_all()
        await settle_until(history, "restored", 20)

    try:
        asyncio.run(run())
    finally:
        restore_flow_module.NAME_GRACE_S = grace
    assert kinds(history) == ["lost", "stale_name_released", "restored"]
    assert [e for e in ops.log if e[0] == "release_stale_name"] == [("release_stale_name", "expert-e1-r0")]


def test_a_name_held_by_a_live_holder_is_not_taken_and_the_restore_fails_after_the_wait():
    reg, ops, history, _, _, flow = setup([NodeRoom("a", 2.0)])
    ops.alive.discard("expert-e1-r0")
    flow.config = dataclasses.replace(flow.config, ping_timeout_s=1.5)  # past NAME_GRACE_S

    class ActorAlreadyExistsError(ValueError):
        pass

    def always_taken(slot, spec, generation, soft=True):
        raise ActorAlreadyExistsError(f"{slot.name} is already taken")

    ops.spawn = always_taken  # and release_stale_name finds no holder on a dead node (stale_names is empty)

    async def run():
        await flow.check_all()
        await settle_until(history, "restore_failed", 30)

    asyncio.run(run())
    assert kinds(history) == ["lost", "restore_failed"]
    assert "ActorAlreadyExistsError" in history.events[-1]["error"]
    assert ("release_stale_name", "expert-e1-r0") in ops.log


def test_a_restore_waits_while_ray_still_holds_the_lost_actors_name():
    reg, ops, history, _, _, flow = setup([NodeRoom("a", 2.0)])
    ops.alive.discard("expert-e1-r0")

    class ActorAlreadyExistsError(ValueError):  # Ray's, by name: the dead actor's name is not released yet
        pass

    refusals = [ActorAlreadyExistsError("expert-e1-r0 is already taken")] * 2
    spawn = ops.spawn

    def slow_release(slot, spec, generation, soft=True):
        if refusals:
            raise refusals.pop()
        return spawn(slot, spec, generation, soft)

    ops.spawn = slow_release

    async def run():
        await flow.check_all()
        for _ in range(5):
            await settle()

    asyncio.run(run())
    assert kinds(history) == ["lost", "restored"] and not refusals and reg.generations["expert-e1-r0"] == 1


def test_two_deferrals_planned_at_one_tick_both_land_and_the_request_counts_each_actor_once():
    """CI chaos drill: two passes each deferred one lost actor (its shard lives on its other replica) at the same
    moment; the second pass's remap target, read from the placement before the first remap retired its actor, named
    that actor again, and the remap refused it ("slots: no slot for new actors"). The target is now computed once
    the remap holds its lock."""
    placement = {"expert-e0-r0": [[0, 0]], "expert-e0-r1": [[0, 0]], "expert-e1-r0": [[0, 1]],
                 "expert-e1-r1": [[0, 1]]}
    reg, ops, history, _, _, flow = setup([NodeRoom("a", 0.0), NodeRoom("b", 0.0)], placement)
    for name in ("expert-e0-r0", "expert-e1-r0"):  # on a node that died; the survivors are full
        ops.alive.discard(name)
        reg.lost.add(name)
        reg.restoring.add(name)
        reg.nodes[name] = "dead"
    reg.nodes.update({"expert-e0-r1": "b", "expert-e1-r1": "b"})

    async def run():
        flow.remapper._lock.acquire()  # another remap in progress: both passes plan and queue behind it
        first = asyncio.create_task(flow.restore_lost(["expert-e0-r0"]))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if "restore_replanned" in kinds(history):
                break
        assert "expert-e0-r0" in reg.displaced and "expert-e0-r0" in reg.spec.actor_shards  # queued, not retired
        second = asyncio.create_task(flow.restore_lost(["expert-e1-r0"]))
        await asyncio.sleep(0.05)
        flow.remapper._lock.release()
        await asyncio.gather(first, second)

    asyncio.run(run())
    assert "restore_failed" not in kinds(history), history.events
    assert kinds(history).count("restore_replanned") == 2 and kinds(history).count("remap") == 2
    assert set(reg.spec.actor_shards) == {"expert-e0-r1", "expert-e1-r1"}
    assert set(reg.displaced) == {"expert-e0-r0", "expert-e1-r0"} and not reg.restoring
    assert len(reg.restore_request) == 4  # each of the 4 actors once, at its normal share
