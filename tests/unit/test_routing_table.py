"""Routing table (`expertmesh.cluster.routing_table`): which actors serve each shard, and splitting a shard's tokens."""

from __future__ import annotations

import pytest

from expertmesh.cluster.routing_table import RoutingTable


def _table(replicas: int, layers: int = 1, experts: int = 2) -> RoutingTable:
    return RoutingTable.from_actor_shards(
        {f"e{e}-r{r}": [(layer, e) for layer in range(layers)] for e in range(experts) for r in range(replicas)}
    )


def test_from_actor_shards_builds_both_maps():
    table = RoutingTable.from_actor_shards(
        {"a": [(0, 0), (1, 0)], "b": [(0, 1), (1, 1)], "c": [(0, 0), (1, 0), (0, 1)]}, epoch=7
    )
    assert table.epoch == 7
    assert table.replicas == {(0, 0): ("a", "c"), (1, 0): ("a", "c"), (0, 1): ("b", "c"), (1, 1): ("b",)}
    assert table.actors == {"a": ((0, 0), (1, 0)), "b": ((0, 1), (1, 1)), "c": ((0, 0), (1, 0), (0, 1))}


def test_default_epoch_is_zero_and_table_is_frozen():
    table = RoutingTable.from_actor_shards({"a": [(0, 0)]})
    assert table.epoch == 0
    with pytest.raises(AttributeError):
        table.epoch = 1  # type: ignore[misc]


def test_replica_order_follows_actor_insertion_order():
    table = RoutingTable.from_actor_shards({"z": [(0, 0)], "a": [(0, 0)], "m": [(0, 0)]})
    assert table.replicas[(0, 0)] == ("z", "a", "m")


def test_split_single_replica_takes_everything():
    table = _table(1)
    assert table.split((0, 1), 5) == [("e1-r0", 0, 5)]
    assert table.split((0, 0), 1) == [("e0-r0", 0, 1)]


def test_split_pinned_examples():
    table = RoutingTable.from_actor_shards({"a": [(0, 0)], "b": [(0, 0)], "c": [(0, 0)]})
    assert table.split((0, 0), 9) == [("a", 0, 3), ("b", 3, 6), ("c", 6, 9)]
    assert table.split((0, 0), 10) == [("a", 0, 3), ("b", 3, 7), ("c", 7, 10)]
    assert table.split((0, 0), 4) == [("a", 0, 1), ("b", 1, 3), ("c", 3, 4)]
    two = RoutingTable.from_actor_shards({"a": [(0, 0)], "b": [(0, 0)]})
    assert two.split((0, 0), 6) == [("a", 0, 3), ("b", 3, 6)]
    assert two.split((0, 0), 5) == [("a", 0, 2), ("b", 2, 5)]


def test_fewer_tokens_than_replicas():
    table = RoutingTable.from_actor_shards({f"r{i}": [(2, 3)] for i in range(4)})
    assert table.split((2, 3), 1) == [("r0", 0, 1)]
    assert table.split((2, 3), 2) == [("r0", 0, 1), ("r1", 1, 2)]
    assert table.split((2, 3), 3) == [("r0", 0, 1), ("r1", 1, 2), ("r2", 2, 3)]


def test_zero_tokens_gives_no_chunks():
    table = RoutingTable.from_actor_shards({"a": [(0, 0)], "b": [(0, 0)]})
    assert table.split((0, 0), 0) == []


@pytest.mark.parametrize("replicas", range(1, 7))
def test_split_properties(replicas):
    table = RoutingTable.from_actor_shards({f"r{i}": [(0, 0)] for i in range(replicas)})
    for num_tokens in range(0, 60):
        chunks = table.split((0, 0), num_tokens)
        actors = [a for a, _, _ in chunks]
        assert len(actors) == len(set(actors)), "at most one chunk per actor"
        assert set(actors) <= set(table.replicas[(0, 0)])
        assert len(chunks) == min(replicas, num_tokens)
        # contiguous, non-empty, covering range(num_tokens) in order
        pos = 0
        for _, start, end in chunks:
            assert start == pos and end > start
            pos = end
        assert pos == num_tokens
        sizes = [end - start for _, start, end in chunks]
        if sizes:
            assert max(sizes) - min(sizes) <= 1, (num_tokens, sizes)
        # replicas are used in preference order
        assert actors == [f"r{i}" for i in range(len(actors))]


def test_missing_shard_raises_key_error():
    table = _table(2, layers=2, experts=2)
    with pytest.raises(KeyError, match="layer=5, expert=0"):
        table.split((5, 0), 3)
    with pytest.raises(KeyError, match="layer=0, expert=9"):
        table.split((0, 9), 3)


def test_shard_with_empty_replica_tuple_raises_key_error():
    table = RoutingTable(replicas={(0, 0): ()})
    with pytest.raises(KeyError):
        table.split((0, 0), 4)
