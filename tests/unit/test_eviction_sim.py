"""The trace simulator (experts/eviction_sim.py) on crafted traces, and on the recorded routing trace of the
embedded model (docs/benchmarks/results/offload/routing-trace.json): the comparison the default order rests on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expertmesh.experts.eviction_sim import compare_policies, simulate

TRACE = Path(__file__).resolve().parents[2] / "docs/benchmarks/results/offload/routing-trace.json"


def _trace(steps: int, layers: int = 4, experts: int = 2, pred_p: float = 0.9) -> dict:
    """One sequence, every layer routing to expert 0 (top-1), the gate predicting expert 0 with pred_p."""
    token = {"experts": [[0] for _ in range(layers)],
             "next_pred": [[[0, pred_p], [1, 1 - pred_p]] for _ in range(layers - 1)]}
    return {"layers": list(range(layers)), "num_experts": experts, "top_k": 1,
            "sequences": [{"tokens": [token] * steps}]}


def test_all_resident_never_loads():
    r = simulate(_trace(5), "lru", 1.0, batch=1)
    assert r["demand_loads"] == 0 and r["hit_rate"] == 1.0 and r["calls"] == 20


def test_lru_on_the_cycle_misses_every_call_layer_cycle_does_not():
    lru = simulate(_trace(10), "lru", 0.5, batch=1)
    cyc = simulate(_trace(10), "layer-cycle", 0.5, batch=1)
    assert lru["demand_loads"] == 38  # two preloaded shards hit once, then the cycle defeats LRU
    assert cyc["demand_loads"] < lru["demand_loads"] * 0.8


def test_gate_prefetch_turns_demand_loads_into_prefetch_loads_and_confidence_gates_it():
    off = simulate(_trace(10), "lru", 0.25, batch=1)
    gate = simulate(_trace(10), "lru", 0.25, batch=1, prefetch="gate")
    assert gate["demand_loads"] < off["demand_loads"] / 2
    assert gate["prefetch_used"] > 0 and gate["prefetch_precision"] >= 0.95  # the last hint has no next step
    shy = simulate(_trace(10, pred_p=0.3), "lru", 0.25, batch=1, prefetch="gate", min_confidence=0.5)
    # the gate's predictions are below the threshold: only the history hint (last layer -> next step's first) goes
    assert shy["prefetch_loads"] <= 10 and shy["demand_loads"] > gate["demand_loads"]


@pytest.fixture(scope="module")
def recorded():
    return json.loads(TRACE.read_text())


def test_recorded_trace_shape(recorded):
    assert recorded["layers"] == [0, 1, 2, 3] and recorded["num_experts"] == 8 and recorded["top_k"] == 2
    assert len(recorded["sequences"]) == 16
    token = recorded["sequences"][0]["tokens"][0]
    assert len(token["experts"]) == 4 and len(token["next_pred"]) == 3


def test_on_the_recorded_trace_layer_cycle_moves_the_fewest_shards_at_half_residency(recorded):
    rows = compare_policies(recorded, ["lru", "lfru", "arc", "layer-cycle"], [0.5], [16, 4], prefetch=["off"])
    for batch in (16, 4):
        moved = {r["policy"]: r["shards_moved"] for r in rows if r["batch"] == batch}
        assert moved["layer-cycle"] == min(moved.values()), moved
        assert moved["layer-cycle"] < 0.8 * moved["lru"], moved


def test_at_one_shard_per_actor_every_order_is_the_same(recorded):
    rows = compare_policies(recorded, ["lru", "arc", "layer-cycle"], [0.25], [16], prefetch=["off"])
    assert len({r["demand_loads"] for r in rows}) == 1
