"""PoolSpec (cluster/pool_spec.py): the one typed pool description the pool, the controller and routers share."""

from __future__ import annotations

import json
import pickle

from expertmesh.cluster.pool_spec import PoolSpec


def test_with_actor_shards_takes_json_lists_and_keeps_the_rest():
    spec = PoolSpec("/m", "bfloat16", {"a": [(0, 1)]}, tracing={"exporter": "console"}, quant="int4")
    published = json.loads(json.dumps({"a": [[0, 1]], "b": [[1, 2], [3, 4]]}))  # as read back from the table store
    moved = spec.with_actor_shards(published)
    assert moved.actor_shards == {"a": [(0, 1)], "b": [(1, 2), (3, 4)]}
    assert all(type(s) is tuple for shards in moved.actor_shards.values() for s in shards)
    assert (moved.model_dir, moved.dtype, moved.tracing, moved.quant) == ("/m", "bfloat16", {"exporter": "console"},
                                                                          "int4")
    assert spec.actor_shards == {"a": [(0, 1)]}  # the original is unchanged


def test_pickles_as_is():
    # Ray ships it to the controller actor (and Ray restarts a crashed controller with the same arguments).
    spec = PoolSpec("/m", "float32", {"expert-e0-r0": [(0, 0), (1, 0)]})
    assert pickle.loads(pickle.dumps(spec)) == spec
