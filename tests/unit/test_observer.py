"""The router observer's step hook without Ray: sequences are followed across steps by their KV cache, and a new
sequence whose cache reuses a freed cache's id does not inherit its history."""

from __future__ import annotations

import json

import numpy as np
import torch

from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.experts.gating import Routing
from expertmesh.experts.kv_cache import KVCache, PagedKVPool
from expertmesh.experts.modeling import StepTrace
from expertmesh.router_service.observability import RouterObserver


def new_cache() -> KVCache:
    """A sequence of a tiny paged pool (the observer reads only its identity and length)."""
    return PagedKVPool([{"k": (1,)}], num_blocks=4, block_size=4, dtype=torch.float32).new_sequence()


class Cfg:
    num_experts = 4
    top_k = 1
    moe_layers = (0,)


class Backend:
    transport = None
    table = RoutingTable.from_actor_shards({"a": [(0, 0), (0, 1)], "b": [(0, 2), (0, 3)]}, epoch=2)


def step(observer: RouterObserver, caches: list[KVCache], top1: list[list[int]]) -> None:
    lengths = [len(t) for t in top1]
    for cache, n in zip(caches, lengths):
        cache.length += n  # as MoEDecoder.forward does before calling the observer
    experts = torch.tensor([e for t in top1 for e in t])[:, None]
    observer.on_step(StepTrace({0: Routing(experts=experts, weights=torch.ones_like(experts, dtype=torch.float))}),
                     lengths, caches)


def test_switches_follow_each_sequence_across_steps():
    obs = RouterObserver(Cfg, Backend(), "test")
    assert obs.metrics is None and obs.tracer is None  # no Ray, no tracing: nothing to record into
    a, b = new_cache(), new_cache()
    step(obs, [a, b], [[0, 0, 1], [2]])  # prefill: a has pairs (0,0) (0,1)
    step(obs, [a, b], [[1], [3]])  # decode: a (1,1), b (2,3)
    counts = obs.window.counts()
    assert (counts["switches"], counts["pairs"]) == ([2.0], [4.0])


def test_a_new_sequence_starts_without_history():
    obs = RouterObserver(Cfg, Backend(), "test")
    a = new_cache()
    step(obs, [a], [[0, 3]])
    a.length = 0  # the same object (same id) now holds a fresh prompt
    step(obs, [a], [[1]])
    assert obs.window.counts()["pairs"] == [1.0]  # only (0,3); the fresh prompt's first token pairs with nothing
    del a
    step(obs, [new_cache()], [[2]])
    assert obs.window.tracked_sequences == 1  # the dead cache's state was dropped


def test_snapshot_names_only_serving_actors_gpu_slots():
    obs = RouterObserver(Cfg, Backend(), "router-1")
    obs.placement = {"a": "n/gpu0", "b": "n/gpu1", "retired": "n/gpu2"}  # as learned from actors' info()
    obs.window.record_dispatch(0, np.array([3, 1, 0, 0]), {"a": 4})
    snap = obs.snapshot()
    json.dumps(snap, allow_nan=False)
    assert snap["router"] == "router-1" and snap["epoch"] == 2
    assert snap["placement"] == {"a": "n/gpu0", "b": "n/gpu1"}
    assert snap["health"]["gpu_load"] == {"n/gpu0": 4.0, "n/gpu1": 0.0}  # a retired actor's GPU is not idle
    assert snap["health"]["gpu_imbalance"] == 2.0
