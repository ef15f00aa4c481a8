"""The Grafana dashboard names only metrics the code defines (with Ray's `ray_` prefix and Prometheus suffixes),
every defined metric is on the dashboard, and every metric the code creates is one of the defined specs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from expertmesh.router_service.metrics import METRIC_SPECS, MetricSpec
from expertmesh.router_service.observability_config import MetricsConfig
from tests.fakes import FakeMetric

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ops" / "monitoring" / "grafana" / "expertmesh-dashboard.json"
PROMQL_FUNCTIONS = {"sum", "max", "min", "avg", "rate", "by", "histogram_quantile", "le", "without", "count"}


def exported_names() -> set[str]:
    return {name for spec in METRIC_SPECS.values() for name in spec.prometheus_names}


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dash["panels"] for t in panel["targets"]]


def metric_names_in(expr: str) -> set[str]:
    """Identifiers outside label matchers, grouping clauses and range selectors that are not PromQL words."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)  # grouping labels
    return {t for t in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if t not in PROMQL_FUNCTIONS}


def test_dashboard_names_only_defined_metrics():
    names = exported_names()
    used = set()
    for expr in dashboard_exprs():
        found = metric_names_in(expr)
        assert found, f"no metric in {expr!r}"
        unknown = found - names
        assert not unknown, f"{expr!r} names metrics the code does not define: {sorted(unknown)}"
        used |= found
    # and every defined metric shows up somewhere
    missing = [s.name for s in METRIC_SPECS.values() if not set(s.prometheus_names) & used]
    assert not missing, f"metrics not on the dashboard: {missing}"


def test_name_parser_catches_an_unknown_metric():
    assert metric_names_in('sum by (layer) (rate(ray_expertmesh_nope_total{a="b"}[1m]))') == {
        "ray_expertmesh_nope_total"}
    assert "ray_expertmesh_nope_total" not in exported_names()


def test_every_metric_the_code_creates_is_a_spec():
    """Names passed to ray.util.metrics constructors anywhere in the package are in METRIC_SPECS."""
    created = set()
    for folder in ("router_service", "experts", "cluster", "ops"):
        for path in (ROOT / folder).rglob("*.py"):
            created |= set(re.findall(r'(?:Counter|Gauge|Histogram)\(\s*"(\w+)"', path.read_text()))
    assert "expertmesh_expert_seconds" in created  # the actor's histogram, defined with the actor
    assert created <= set(METRIC_SPECS), sorted(created - set(METRIC_SPECS))


def test_prometheus_names_follow_rays_exporter():
    assert MetricSpec("a", "counter", "").prometheus_names == ["ray_a_total"]
    assert MetricSpec("a", "gauge", "").prometheus_names == ["ray_a"]
    assert MetricSpec("a", "histogram", "").prometheus_names == ["ray_a_bucket", "ray_a_sum", "ray_a_count"]


def test_labels_are_bounded():
    for spec in METRIC_SPECS.values():
        assert set(spec.tags) <= {"layer", "expert", "replica"}, spec.name


def test_shard_labels_switch_off_for_large_models():
    cfg = MetricsConfig()
    assert cfg.shard_labels(4 * 8) and not cfg.shard_labels(58 * 256)
    assert MetricsConfig(per_shard_labels=True).shard_labels(58 * 256)
    with pytest.raises(ValueError, match="max_shard_labels"):
        MetricsConfig(max_shard_labels=0).validate()


class Call:
    def __init__(self, actor, experts, counts):
        self.actor, self.experts, self.counts = actor, experts, counts


@pytest.fixture
def fake_metrics(monkeypatch):
    from expertmesh.router_service import metrics

    monkeypatch.setattr(metrics, "_make", FakeMetric)
    return metrics


@pytest.mark.parametrize("per_shard", [True, False])
def test_router_metrics_batch_between_flushes_and_aggregate_per_layer(fake_metrics, per_shard):
    import numpy as np

    now = [0.0]
    m = fake_metrics.RouterMetrics([0, 2], 4, MetricsConfig(per_shard_labels=per_shard, flush_interval_s=1.0),
                                   clock=lambda: now[0])
    for _ in range(3):  # three steps before a flush: one inc per series at the flush, not per step
        m.record_layer(0, np.array([2, 0, 1, 1]), [Call("a", [0, 2], [2, 1]), Call("b", [3], [1])], 0.01)
        m.record_layer(2, np.array([0, 4, 0, 0]), [Call("b", [1], [4])], 0.02, rerouted=1)
    assert not m.due() and m.m["expertmesh_shard_tokens"].calls == 0
    now[0] = 1.5
    assert m.due()
    m.flush()
    tokens = m.m["expertmesh_shard_tokens"].values
    if per_shard:
        assert tokens == {(("expert", "0"), ("layer", "0")): 6.0, (("expert", "2"), ("layer", "0")): 3.0,
                          (("expert", "3"), ("layer", "0")): 3.0, (("expert", "1"), ("layer", "2")): 12.0}
    else:
        assert tokens == {(("expert", "all"), ("layer", "0")): 12.0, (("expert", "all"), ("layer", "2")): 12.0}
    assert m.m["expertmesh_replica_tokens"].values == {(("replica", "a"),): 9.0, (("replica", "b"),): 15.0}
    assert m.m["expertmesh_replica_calls"].values == {(("replica", "a"),): 3.0, (("replica", "b"),): 6.0}
    assert m.m["expertmesh_rerouted_tokens"].values == {(("layer", "2"),): 3.0}
    assert m.m["expertmesh_dispatch_seconds"].values == {(("layer", "0"),): 3, (("layer", "2"),): 3}
    m.flush()  # nothing new: no increments
    assert m.m["expertmesh_replica_tokens"].values == {(("replica", "a"),): 9.0, (("replica", "b"),): 15.0}


def test_table_gauges_report_breakers_and_live_replicas(fake_metrics):
    from expertmesh.cluster.breaker import BreakerBoard, BreakerState
    from expertmesh.cluster.routing_table import RoutingTable

    table = RoutingTable.from_actor_shards({"a": [(0, 0), (0, 1)], "b": [(0, 0)], "c": [(0, 1)]}, epoch=3)
    board = BreakerBoard()
    board.states["c"] = BreakerState(state="open")
    per_shard = fake_metrics.RouterMetrics([0], 2, MetricsConfig()).table_gauges(table, {"b"}, board)
    assert per_shard["expertmesh_breaker_state"] == {(("replica", "a"),): 0, (("replica", "b"),): 0,
                                                     (("replica", "c"),): 2}
    assert per_shard["expertmesh_live_replicas"] == {(("layer", "0"), ("expert", "0")): 1,
                                                     (("layer", "0"), ("expert", "1")): 1}
    assert per_shard["expertmesh_routing_epoch"] == 3
    per_layer = fake_metrics.RouterMetrics([0], 2, MetricsConfig(per_shard_labels=False)).table_gauges(
        table, {"a", "b"}, board)
    assert per_layer["expertmesh_live_replicas"] == {(("layer", "0"), ("expert", "all")): 0}
