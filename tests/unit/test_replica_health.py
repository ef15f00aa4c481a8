"""ReplicaHealth (router_service/replica_health.py): which replicas take a call, without Ray or a transport."""

from __future__ import annotations

import torch

from expertmesh.cluster.breaker import OPEN
from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.experts.gating import DROPPED, Routing
from expertmesh.router_service.failover_config import FailoverConfig
from expertmesh.router_service.replica_health import ReplicaHealth
from tests.fakes import FakeClock


class ActorDied(Exception):
    """Stands in for Ray's RayActorError (the default death test imports Ray)."""


def _health(clock: FakeClock, reviver=None, revive_interval_s: float = 2.0) -> ReplicaHealth:
    failover = FailoverConfig(revive_interval_s=revive_interval_s).validate()
    return ReplicaHealth(failover, reviver=reviver, clock=clock, is_death=lambda e: isinstance(e, ActorDied))


def _table() -> RoutingTable:
    # expert 0 on a and b, expert 1 on b, expert 2 on c (layer 0)
    return RoutingTable.from_actor_shards({"a": [(0, 0)], "b": [(0, 0), (0, 1)], "c": [(0, 2)]})


def _routing(experts: list[list[int]]) -> Routing:
    e = torch.tensor(experts, dtype=torch.int64)
    return Routing(experts=e, weights=torch.full(e.shape, 0.5))


def _trip(health: ReplicaHealth, actor: str) -> None:
    for _ in range(health.breakers.cfg.consecutive_failures):
        health.breakers.record(actor, health.clock(), ok=False)
    assert health.breakers.get(actor).state == OPEN


def test_live_replicas_skip_dead_and_ejected_actors_but_has_live_replica_ignores_breakers():
    health, table = _health(FakeClock()), _table()
    assert health.live_replicas(table, (0, 0)) == ["a", "b"]
    health.dead.add("a")
    assert health.live_replicas(table, (0, 0)) == ["b"]
    _trip(health, "b")
    assert health.live_replicas(table, (0, 0)) == ["b"]  # every live replica ejected: the last one still serves
    health.dead.clear()
    assert health.live_replicas(table, (0, 0)) == ["a"]  # the ejected replica is skipped while another is usable
    health.dead.add("c")
    assert health.live_replicas(table, (0, 2)) == [] and not health.has_live_replica(table, (0, 2))
    assert health.has_live_replica(table, (0, 1))  # b is ejected, not dead: the shard can be served
    assert not health.has_live_replica(table, (0, 9))  # a shard the table does not name


def test_replicas_of_is_the_tables_own_while_everything_is_healthy():
    health, table = _health(FakeClock()), _table()
    assert health.replicas_of(table) is None  # plan_calls' fast path: the table's replicas, no breaker touched
    health.dead.add("a")
    pick = health.replicas_of(table)
    assert pick is not None and pick((0, 0)) == ["b"] and pick((0, 2)) == ["c"]
    health.dead.clear()
    _trip(health, "b")
    assert health.replicas_of(table)((0, 0)) == ["a"]


def test_missing_experts_names_routed_experts_without_a_live_replica():
    health, table = _health(FakeClock()), _table()
    routing = _routing([[2, 0], [1, DROPPED], [2, 1]])
    assert health.missing_experts(table, 0, routing) == []
    health.dead.update({"b", "c"})
    assert health.missing_experts(table, 0, routing) == [1, 2]  # ascending; 0 still has a; dropped slots ignored
    assert health.missing_experts(table, 0, _routing([[DROPPED]])) == []
    assert health.missing_experts(table, 1, _routing([[0]])) == [0]  # a layer the table does not serve


def test_live_replica_counts_follow_the_dead_set_and_the_table():
    health, table = _health(FakeClock()), _table()
    assert health.live_replica_counts(table, 0, 4).tolist() == [2, 1, 1, 0]
    health.dead.add("b")
    assert health.live_replica_counts(table, 0, 4).tolist() == [1, 0, 1, 0]  # not the cached counts
    assert health.live_mask(table, 0, 4).tolist() == [True, False, True, False]
    other = RoutingTable.from_actor_shards({"d": [(0, 1)]})
    assert health.live_replica_counts(other, 0, 4).tolist() == [0, 1, 0, 0]
    counts = health.live_replica_counts(other, 0, 4)
    assert health.live_replica_counts(other, 0, 4) is counts  # cached per (table, dead set)
    assert counts.dtype == torch.int64 and counts.device.type == "cpu"


def test_a_failed_call_trips_the_breaker_and_only_a_death_makes_the_actor_dead():
    health = _health(FakeClock())
    health.mark_failed("a", TimeoutError("slow"))
    assert "a" not in health.dead and health.failed_in_step == {"a"}
    assert health.breakers.get("a").consecutive_failures == 1
    health.record_ok("a")
    assert health.breakers.get("a").consecutive_failures == 0
    health.mark_failed("b", ActorDied())
    assert health.dead == {"b"} and health.gone() == {"a", "b"}
    health.new_step()
    assert health.failed_in_step == set() and health.gone() == {"b"}  # dead lasts across steps
    health.forget("b")
    assert health.dead == set() and "b" not in health.breakers.states


def test_revive_asks_at_most_every_interval_unless_forced_and_closes_the_breakers_of_those_back():
    clock, asked = FakeClock(), []

    def reviver(dead: set[str]) -> set[str]:
        asked.append(sorted(dead))
        return {"a"} & dead

    health = _health(clock, reviver, revive_interval_s=2.0)
    health.revive()
    assert asked == []  # nothing dead: nothing to ask
    health.mark_failed("a", ActorDied())
    health.mark_failed("b", ActorDied())
    health.revive()
    assert asked == [["a", "b"]] and health.dead == {"b"} and "a" not in health.breakers.states
    health.revive()
    assert len(asked) == 1  # within the interval
    clock.now += 2.0
    health.revive()
    assert len(asked) == 2
    health.revive(force=True)  # the `wait` policy polls while a step is held
    assert asked[-1] == ["b"] and len(asked) == 3
