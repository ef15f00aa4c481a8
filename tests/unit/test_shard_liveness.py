"""The last-live-replica guard and the health verdict (cluster/shard_liveness.py): which shards a drain or kill would
orphan, which have no live replica now, and when the no-replica policy still serves."""

from __future__ import annotations

import pytest

from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.cluster.shard_liveness import health_verdict, orphaned_by_removal, unserved_shards

# Two MoE layers, three experts; expert 0 has two replicas, experts 1 and 2 one each (the default layout's names).
PLACEMENT = {
    "expert-e0-r0": [(0, 0), (1, 0)],
    "expert-e0-r1": [(0, 0), (1, 0)],
    "expert-e1-r0": [(0, 1), (1, 1)],
    "expert-e2-r0": [(0, 2), (1, 2)],
}
SHARDS = [(layer, e) for layer in (0, 1) for e in range(3)]
REPLICAS = RoutingTable.from_actor_shards(PLACEMENT).replicas


def test_removing_the_only_replica_orphans_every_shard_it_hosts():
    assert orphaned_by_removal(PLACEMENT, set(), "expert-e1-r0") == [(0, 1), (1, 1)]


def test_removing_one_of_two_live_replicas_orphans_nothing():
    assert orphaned_by_removal(PLACEMENT, set(), "expert-e0-r0") == []


def test_a_peer_that_is_down_does_not_count_as_a_live_replica():
    # Whatever made the peer not live (the controller folds drained, lost and restoring into `down`), it cannot serve.
    assert orphaned_by_removal(PLACEMENT, {"expert-e0-r1"}, "expert-e0-r0") == [(0, 0), (1, 0)]


def test_removing_an_actor_that_is_already_down_still_counts_its_shards():
    # Draining a replica that is being restored takes away the shard's last hope of a replica.
    assert orphaned_by_removal(PLACEMENT, {"expert-e2-r0"}, "expert-e2-r0") == [(0, 2), (1, 2)]


def test_only_the_shards_without_another_live_replica_are_named():
    placement = {"a": [(0, 0), (0, 1)], "b": [(0, 1)]}
    assert orphaned_by_removal(placement, set(), "a") == [(0, 0)]


def test_removing_an_unknown_actor_is_a_caller_error():
    with pytest.raises(AssertionError):
        orphaned_by_removal(PLACEMENT, set(), "expert-e9-r0")


def test_unserved_shards_counts_shards_missing_from_the_table():
    # After a drain is published, the drained actor's shards drop out of the routing table altogether.
    table = RoutingTable.from_actor_shards({n: s for n, s in PLACEMENT.items() if n != "expert-e2-r0"}).replicas
    assert unserved_shards(SHARDS, table, set()) == [(0, 2), (1, 2)]
    assert unserved_shards(SHARDS, REPLICAS, set()) == []
    assert unserved_shards(SHARDS, REPLICAS, {"expert-e0-r0"}) == []
    assert unserved_shards(SHARDS, REPLICAS, {"expert-e0-r0", "expert-e0-r1"}) == [(0, 0), (1, 0)]


def test_wait_policy_is_not_serving_while_any_shard_has_no_live_replica():
    verdict = health_verdict(SHARDS, REPLICAS, {"expert-e1-r0"}, "wait")
    assert not verdict.serving
    assert verdict.unserved == ((0, 1), (1, 1))
    assert "(layer 0, expert 1)" in verdict.reason and "(layer 1, expert 1)" in verdict.reason
    assert health_verdict(SHARDS, REPLICAS, {"expert-e0-r1"}, "wait").serving  # a peer still serves


def test_degrade_policy_serves_while_every_layer_keeps_a_live_expert():
    verdict = health_verdict(SHARDS, REPLICAS, {"expert-e1-r0"}, "degrade")
    assert verdict.serving and verdict.unserved == ((0, 1), (1, 1)) and verdict.reason.startswith("degraded")


def test_degrade_policy_is_not_serving_when_a_layer_has_no_live_expert_at_all():
    placement = {"x": [(0, 0), (0, 1)], "y": [(1, 0)], "z": [(1, 1)]}
    replicas = RoutingTable.from_actor_shards(placement).replicas
    shards = [(0, 0), (0, 1), (1, 0), (1, 1)]
    verdict = health_verdict(shards, replicas, {"x"}, "degrade")
    assert not verdict.serving and "layer(s) [0]" in verdict.reason
    assert health_verdict(shards, replicas, {"y"}, "degrade").serving


def test_all_live_is_serving_under_either_policy():
    for policy in ("wait", "degrade"):
        verdict = health_verdict(SHARDS, REPLICAS, set(), policy)
        assert verdict.serving and verdict.unserved == ()
