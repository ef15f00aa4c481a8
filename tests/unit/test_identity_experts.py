"""LongCat-Flash's zero-compute (identity) experts on the serving path, without Ray: the dispatcher never plans a
call for them (their slots reach it DROPPED, `split_identity`), the served result equals the in-process reference bit
for bit, a degraded re-route leaves them alone, and they are counted in the load window
(`counts["identity"]`, merged across routers) and in the `expertmesh_identity_tokens` metric per layer. Placement:
shards are the real experts only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertmesh.cluster.load_stats import LoadWindow, merge_snapshots
from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.experts.config import config_from_dict
from expertmesh.experts.gating import DROPPED, degrade, route_softmax_scaled, split_identity
from expertmesh.experts.reference import LocalExperts
from expertmesh.router_service.dispatch import RemoteExperts
from expertmesh.router_service.metrics import MetricsConfig
from tests.fakes import HIDDEN, FakeMetric, FakeTransport, expert_weights

E, Z, K = 4, 4, 3


def _split(tokens: int, seed: int, identity_boost: float = 0.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E + Z, generator=gen)
    logits[:, E:] += identity_boost
    return split_identity(route_softmax_scaled(logits, K, routed_scaling_factor=2.5), E)


class _Observer:
    def __init__(self):
        self.layers = []

    def on_layer(self, layer, served, calls, seconds):
        self.layers.append((layer, served.identity, len(calls)))


def test_dispatcher_calls_only_real_experts_and_equals_the_reference():
    shards = expert_weights(1, E, seed=1)
    table = RoutingTable.from_actor_shards({f"a{e}": [(0, e)] for e in range(E)})
    transport = FakeTransport(table, shards)
    remote = RemoteExperts(table, transport)
    remote.observer = _Observer()
    hidden = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(2))
    served, identity_weight = _split(12, 3)
    assert served.identity > 0 and int((served.experts >= 0).sum()) > 0  # both kinds picked
    got = remote.run(0, hidden, served)
    assert torch.equal(got, LocalExperts(shards, "silu").run(0, hidden, served))
    hit = sorted({int(e) for e in served.experts.reshape(-1) if e >= 0})
    assert sorted(s[0] for s in transport.submitted) == [f"a{e}" for e in hit]  # no identity call, no actor
    assert remote.calls_per_layer == {0: len(hit)}
    assert remote.effective_routing(0, served).identity == served.identity
    assert remote.observer.layers == [(0, served.identity, len(hit))]
    assert identity_weight.shape == (12,) and (identity_weight > 0).any()


def test_tokens_routed_only_to_identity_experts_make_no_calls():
    shards = expert_weights(1, E)
    table = RoutingTable.from_actor_shards({f"a{e}": [(0, e)] for e in range(E)})
    transport = FakeTransport(table, shards)
    remote = RemoteExperts(table, transport)
    served, _ = _split(5, 4, identity_boost=50.0)  # every slot an identity expert
    assert bool((served.experts == DROPPED).all()) and served.identity == 5 * K
    out = remote.run(0, torch.randn(5, HIDDEN), served)
    assert torch.equal(out, torch.zeros(5, HIDDEN)) and transport.submitted == []


def test_degrade_moves_real_slots_only_and_does_not_count_identity_as_dropped():
    served, _ = _split(16, 5)
    available = torch.ones(E, dtype=torch.bool)
    available[int(served.experts[served.experts >= 0][0])] = False
    moved = degrade(served, available)
    identity = served.experts == DROPPED
    assert torch.equal(moved.experts == DROPPED, identity)  # real slots found another real expert
    assert moved.degraded > 0 and moved.dropped == 0 and moved.identity == served.identity
    assert moved.experts.max() < E and not bool(available[moved.experts[moved.experts >= 0]].logical_not().any())


@pytest.fixture
def fake_metrics(monkeypatch):
    from expertmesh.router_service import metrics

    monkeypatch.setattr(metrics, "_make", FakeMetric)
    return metrics


def test_load_window_and_metrics_count_identity_slots(fake_metrics):
    clock = [0.0]
    windows = [LoadWindow([0, 2], E, K, clock=lambda: clock[0]) for _ in range(2)]
    windows[0].record_dispatch(0, np.array([1.0, 0, 2, 0]), {"a0": 1, "a2": 2}, identity=5)
    windows[0].record_dispatch(2, np.array([0.0, 1, 0, 0]), {"a1": 1}, identity=2)
    windows[1].record_dispatch(0, np.array([0.0, 0, 0, 3]), {"a3": 3}, identity=1)
    snaps = [w.snapshot() for w in windows]
    assert [s["counts"]["identity"] for s in snaps] == [7, 1]
    assert merge_snapshots(snaps)["counts"]["identity"] == 8
    assert np.sum(snaps[0]["counts"]["shard_load"]) == 4.0  # identity slots are in no shard's load
    old = dict(snaps[1], counts={k: v for k, v in snaps[1]["counts"].items() if k != "identity"})
    assert merge_snapshots([snaps[0], old])["counts"]["identity"] == 7  # a router without the field: none

    m = fake_metrics.RouterMetrics([0, 2], E, MetricsConfig(flush_interval_s=1.0), clock=lambda: clock[0])
    m.record_layer(0, np.array([1, 0, 2, 0]), [], 0.01, identity=5)
    m.record_layer(2, np.array([0, 1, 0, 0]), [], 0.01, identity=2)
    m.record_layer(0, np.array([0, 0, 0, 0]), [], 0.01, identity=1)
    m.flush()
    assert m.m["expertmesh_identity_tokens"].values == {(("layer", "0"),): 6.0, (("layer", "2"),): 2.0}


def test_placement_covers_real_experts_only():
    from tests.tiny_longcat_flash import hf_config

    cfg = config_from_dict(hf_config().to_dict())
    shards = [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)]  # what start-up places
    assert shards == [(0, 0), (0, 1), (0, 2), (0, 3), (2, 0), (2, 1), (2, 2), (2, 3)]
    assert cfg.router_width == E + Z and cfg.zero_experts == Z
