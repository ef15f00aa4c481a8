"""Expert-affinity admission (router_service/affinity.py) and its trace simulator (router_service/affinity_sim.py):
overlap first, the fairness bound first of all, and on a two-topic workload fewer expert loads than FIFO."""

from __future__ import annotations

import json
from pathlib import Path

from expertmesh.router_service.affinity import Waiting, admit, admit_fifo, signature
from expertmesh.router_service.affinity_sim import simulate_admission

TRACE = Path(__file__).resolve().parents[2] / "docs/benchmarks/results/offload/routing-trace.json"


def _w(rid, arrived, *experts):
    return Waiting(rid, arrived, frozenset(experts))


def test_signature_keeps_the_most_frequent_experts():
    rows = [[0, 1], [1, 2], [1, -1]]
    assert signature(rows) == {0, 1, 2}
    assert signature(rows, keep=1) == {1}
    assert signature(rows, keep=2) == {0, 1}  # tie between 0 and 2: the lower id


def test_affinity_prefers_the_request_adding_fewest_experts():
    waiting = [_w(1, 0.0, 4, 5), _w(2, 1.0, 0, 1), _w(3, 2.0, 0, 6)]
    assert admit(waiting, {9: frozenset({0, 1})}, free=1, now=3.0, max_wait_s=10.0) == [2]
    # the batch's set grows as each is admitted: 3 adds {6} after 2, 1 adds two
    assert admit(waiting, {9: frozenset({0, 1})}, free=2, now=3.0, max_wait_s=10.0) == [2, 3]
    assert admit_fifo(waiting, free=2) == [1, 2]


def test_a_request_past_the_wait_bound_goes_first_whatever_its_experts():
    waiting = [_w(1, 0.0, 4, 5), _w(2, 5.0, 0, 1)]
    assert admit(waiting, {9: frozenset({0, 1})}, free=1, now=10.0, max_wait_s=10.0) == [1]
    assert admit(waiting, {9: frozenset({0, 1})}, free=1, now=9.0, max_wait_s=10.0) == [2]
    assert admit(waiting, {}, free=0, now=20.0, max_wait_s=1.0) == []


def _two_topics(requests=8, tokens=12):
    """Even requests route to experts {0, 1} at every layer, odd ones to {6, 7}."""
    seqs = []
    for r in range(requests):
        pair = [0, 1] if r % 2 == 0 else [6, 7]
        seqs.append({"tokens": [{"experts": [pair] * 4} for _ in range(tokens)]})
    return {"layers": [0, 1, 2, 3], "num_experts": 8, "top_k": 2, "sequences": seqs}


def test_on_two_topics_affinity_halves_the_loads_within_the_latency_bound():
    trace = _two_topics()
    fifo = simulate_admission(trace, "fifo", batch=2, prompt=4, decode=8)
    aff = simulate_admission(trace, "affinity", batch=2, prompt=4, decode=8)
    assert fifo["shards_touched_per_request"] >= 1.9 * aff["shards_touched_per_request"]
    assert fifo["loads_per_request"] >= 1.5 * aff["loads_per_request"]
    assert aff["latency_p99_steps"] <= 1.2 * fifo["latency_p99_steps"]


def test_the_wait_bound_trades_loads_for_tail_latency():
    """Overloaded (a request a step, two slots, eight steps each): with a loose bound affinity keeps a topic together
    and the last request of the other topic waits longer than under FIFO; a tight bound admits by age, as FIFO."""
    trace = _two_topics(requests=8)
    fifo = simulate_admission(trace, "fifo", batch=2, prompt=4, decode=8, gap=1.0)
    loose = simulate_admission(trace, "affinity", batch=2, prompt=4, decode=8, gap=1.0, max_wait_steps=100.0)
    tight = simulate_admission(trace, "affinity", batch=2, prompt=4, decode=8, gap=1.0, max_wait_steps=2.0)
    assert loose["loads_per_request"] < 0.8 * fifo["loads_per_request"]
    assert loose["latency_max_steps"] > fifo["latency_max_steps"]
    assert tight["latency_max_steps"] <= fifo["latency_max_steps"]


def test_on_the_recorded_trace_affinity_does_not_pay():
    """Measured, not wished: the embedded model's routing is not topic-specific (every held-out file uses all 8
    experts, the top two take ~42 % of the picks), so grouping by signature saves nothing (README: Offload)."""
    trace = json.loads(TRACE.read_text())
    fifo = simulate_admission(trace, "fifo", batch=4)
    aff = simulate_admission(trace, "affinity", batch=4, signature_size=4)
    assert aff["loads_per_request"] > 0.9 * fifo["loads_per_request"]
