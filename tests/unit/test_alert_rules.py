"""The Prometheus alerting rules (ops/monitoring/alerts/expertmesh_rules.yml): promtool accepts them, their rule
tests (ops/monitoring/alerts/tests/*.yml) pass with every alert both firing and staying silent, and every metric they
name is one the code exports (so a rename breaks this test, not the alerts in production).

promtool comes with Debian's prometheus package (ops/setup.sh). Without it the promtool tests skip on a developer
machine and fail in CI (CI=true), where the rules must be checked."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from expertmesh.router_service.metrics import METRIC_SPECS

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "ops" / "monitoring" / "alerts"
RULES = ALERTS / "expertmesh_rules.yml"
RULE_TESTS = sorted((ALERTS / "tests").glob("*.yml"))
# The expert-offload metrics (memory tiers, issue 15 item 1), exported by the expert actors; listed here so a
# rename on either side fails this test.
OFFLOAD_METRICS = {
    "ray_expertmesh_expert_tier_hits_total", "ray_expertmesh_expert_tier_misses_total",
    "ray_expertmesh_expert_tier_bytes_moved_total", "ray_expertmesh_expert_tier_stall_seconds_total",
    "ray_expertmesh_expert_resident_bytes", "ray_expertmesh_expert_memory_budget_bytes",
}
PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "rate", "increase", "by", "without", "on", "ignoring",
                "group_left", "group_right", "and", "or", "unless", "bool", "offset"}


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing in CI: install Debian's prometheus package (ops/setup.sh)")
        pytest.skip("promtool not installed (Debian: apt-get install prometheus; ops/setup.sh)")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_promtool(), *args], cwd=ALERTS, capture_output=True, text=True, timeout=60)


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_checks_the_rules():
    done = _run("check", "rules", RULES.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


def test_promtool_rule_tests_pass():
    assert RULE_TESTS, "no rule tests in ops/monitoring/alerts/tests"
    done = _run("test", "rules", *(str(p.relative_to(ALERTS)) for p in RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_tested_firing_and_silent():
    firing, silent = set(), set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = {rule["alert"] for rule in _rules()}
    assert alerts - firing == set(), "alerts no test makes fire"
    assert alerts - silent == set(), "alerts no test checks silent"


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers outside label matchers, range selectors, grouping
    and matching clauses, string literals and numbers, that are not PromQL words."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    return {t for t in re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if t not in PROMQL_WORDS}


def test_every_metric_the_rules_name_is_exported():
    exported = {name for spec in METRIC_SPECS.values() for name in spec.prometheus_names} | OFFLOAD_METRICS
    used = set()
    for rule in _rules():
        names = metric_names(rule["expr"])
        assert names, f"{rule['alert']}: no metric found in its expression"
        assert names <= exported, f"{rule['alert']} names metrics nobody exports: {sorted(names - exported)}"
        used |= names
    assert {"ray_expertmesh_shard_tokens_total", "ray_expertmesh_shed_tokens_total",
            "ray_expertmesh_expert_tier_stall_seconds_total"} <= used


def test_metric_name_parser_sees_through_promql():
    expr = ('sum by (layer) (rate(ray_expertmesh_nope_total{expert!="all"}[5m])) / on (layer) group_left '
            'count by (layer) (x_metric) > 1.5')
    assert metric_names(expr) == {"ray_expertmesh_nope_total", "x_metric"}
