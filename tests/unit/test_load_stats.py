"""Load statistics: pinned small examples for every routing health metric, the sliding window, and merging."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from expertmesh.cluster.load_stats import (
    LoadStatsConfig,
    LoadWindow,
    distinct_experts,
    gpu_load,
    health,
    imbalance,
    load_std,
    merge_snapshots,
    routing_entropy,
    top1_switches,
)
from tests.fakes import FakeClock


def test_imbalance_and_std_pinned():
    load = np.array([[4.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert imbalance(load).tolist() == [4.0, 1.0, 0.0]  # all on one of 4 experts, even, no load
    assert load_std(load).tolist() == pytest.approx([math.sqrt(3.0), 0.0, 0.0])  # std of (4,0,0,0) = sqrt(3)


def test_gpu_load_sums_actors_per_slot_and_keeps_idle_slots():
    replica = {"a": 3.0, "b": 1.0, "c": 2.0}
    placement = {"a": "n1/gpu0", "b": "n1/gpu0", "c": "n1/gpu1", "d": "n2/gpu0"}
    assert gpu_load(replica, placement) == {"n1/gpu0": 4.0, "n1/gpu1": 2.0, "n2/gpu0": 0.0}
    assert imbalance(np.array([4.0, 2.0, 0.0])) == pytest.approx(2.0)  # max 4 / mean 2
    assert gpu_load({"a": 1.0, "x": 2.0}, None) == {"a": 1.0, "x": 2.0}  # no placement: one slot per actor


def test_routing_entropy_pinned():
    probs = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0]])
    assert routing_entropy(probs).tolist() == pytest.approx([0.0, math.log(4), math.log(2)])


def test_distinct_experts_counts_dropped_and_duplicates():
    experts = torch.tensor([[0, 1], [2, -1], [-1, -1], [3, 3]])
    assert distinct_experts(experts).tolist() == [2, 1, 0, 1]


def test_top1_switches_across_sequences_and_steps():
    # two sequences: [0, 0, 1] (fresh) and [2, 3] whose previous token's top-1 was 3
    switches, pairs, last = top1_switches(torch.tensor([0, 0, 1, 2, 3]), [3, 2], [-1, 3])
    # seq 0 pairs: (0,0) (0,1) -> 1 switch; seq 1 pairs: (3,2) (2,3) -> 2 switches; no pair across sequences
    assert (switches, pairs, last) == (3, 4, [1, 3])
    # a sequence with no token this step keeps its previous top-1
    assert top1_switches(torch.tensor([5]), [0, 1], [7, 5]) == (0, 1, [7, 5])
    # a dropped top slot makes no pair
    assert top1_switches(torch.tensor([-1, 2]), [2], [2])[:2] == (0, 0)


def window(clock, **config) -> LoadWindow:
    return LoadWindow([1, 3], num_experts=4, top_k=2, config=LoadStatsConfig(**config), clock=clock)


def test_window_counts_and_shard_load_rows_follow_moe_layers():
    clock = FakeClock()
    w = window(clock)
    w.record_dispatch(1, np.array([3, 1, 0, 0]), {"a": 3, "b": 1})
    w.record_dispatch(3, np.array([0, 0, 2, 2]), {"b": 4})
    assert w.shard_load().tolist() == [[3, 1, 0, 0], [0, 0, 2, 2]]
    assert w.replica_load() == {"a": 3.0, "b": 5.0}


def test_window_slides_bucket_by_bucket():
    clock = FakeClock()
    w = window(clock, window_s=10.0, bucket_s=5.0)
    w.record_dispatch(1, np.array([1, 0, 0, 0]), {"a": 1})
    clock.now += 6  # second bucket
    w.record_dispatch(1, np.array([0, 1, 0, 0]), {"a": 1})
    assert w.shard_load()[0].tolist() == [1, 1, 0, 0]
    clock.now += 5  # 11 s after the first record: its bucket left the window
    assert w.shard_load()[0].tolist() == [0, 1, 0, 0]
    assert w.replica_load() == {"a": 1.0}
    clock.now += 10
    assert w.shard_load().sum() == 0 and w.replica_load() == {}


def test_snapshot_health_pinned_and_json_able():
    clock = FakeClock()
    w = window(clock)
    # step 1: seq "s" prefills 3 tokens at layer 1
    experts = torch.tensor([[0, 1], [0, 2], [3, 0]])
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 3)
    w.record_routing(1, experts, probs, [3], ["s"])
    w.record_dispatch(1, torch.bincount(experts.flatten(), minlength=4).numpy(), {"a": 4, "b": 2})
    # step 2: one decode token, top-1 3 again -> no switch across the step boundary
    w.record_routing(1, torch.tensor([[3, 1]]), torch.tensor([[0.25] * 4]), [1], ["s"])
    w.record_dispatch(1, np.array([0, 1, 0, 1]), {"a": 2})
    snap = w.snapshot(placement={"a": "n/gpu0", "b": "n/gpu1"}, epoch=7)
    json.dumps(snap, allow_nan=False)
    h = snap["health"]
    assert snap["counts"]["shard_load"] == [[3, 2, 1, 2], [0, 0, 0, 0]]
    assert snap["counts"]["tokens"] == [4, 0] and snap["epoch"] == 7
    assert h["imbalance_per_layer"] == [1.5, 0.0]  # max 3 / mean 2
    assert h["load_std"][0] == pytest.approx(math.sqrt(0.5))  # (3,2,1,2): deviations 1,0,-1,0
    assert h["routing_entropy"][0] == pytest.approx((3 * math.log(2) + math.log(4)) / 4)
    assert h["routing_entropy_norm"][0] == pytest.approx(h["routing_entropy"][0] / math.log(4))
    # pairs: (0,0) (0,3) (3,3) -> 1 switch of 3
    assert h["switch_rate"][0] == pytest.approx(1 / 3)
    # 4 tokens x 2 distinct experts out of 4, over the 4 tokens routed in all layers
    assert h["active_param_density"] == pytest.approx(0.5)
    # step 1 hit {0,1,2,3} = 4, step 2 hit {1,3} = 2 -> mean 3 of 4
    assert h["expert_coverage"][0] == pytest.approx(0.75)
    assert h["gpu_load"] == {"n/gpu0": 6.0, "n/gpu1": 2.0} and h["gpu_imbalance"] == pytest.approx(1.5)


def test_sequence_state_is_dropped_for_ended_sequences():
    w = window(FakeClock())
    w.record_routing(1, torch.tensor([[0, 1]]), None, [1], ["x"])
    w.record_routing(1, torch.tensor([[2, 1]]), None, [1], ["y"])
    assert w.tracked_sequences == 2
    w.retain({"y"})
    assert w.tracked_sequences == 1
    w.forget(["y"])
    assert w.tracked_sequences == 0


def test_merge_adds_counts_and_recomputes_health():
    clock = FakeClock()
    a, b = window(clock), window(clock)
    a.record_dispatch(1, np.array([4, 0, 0, 0]), {"r0": 4})
    b.record_dispatch(1, np.array([0, 4, 0, 0]), {"r0": 1, "r1": 3})
    merged = merge_snapshots([a.snapshot(), b.snapshot()])
    assert merged["routers"] == 2
    assert merged["counts"]["shard_load"][0] == [4, 4, 0, 0]
    assert merged["counts"]["replica_load"] == {"r0": 5.0, "r1": 3.0}
    assert merged["health"]["imbalance_per_layer"][0] == pytest.approx(2.0)  # each alone would say 4.0
    assert merge_snapshots([]) is None


def test_health_of_empty_counts_is_zero_not_nan():
    w = window(FakeClock())
    h = health(w.counts(), 4)
    json.dumps(h, allow_nan=False)
    assert h["imbalance"] == 0.0 and h["active_param_density"] == 0.0


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="window_s"):
        LoadStatsConfig(window_s=1.0, bucket_s=5.0).validate()
    with pytest.raises(ValueError, match="bucket_s"):
        LoadStatsConfig(bucket_s=0).validate()


def test_record_step_over_layers_equals_layer_by_layer():
    gen = torch.Generator().manual_seed(0)
    clock = FakeClock()
    a, b = window(clock), window(clock)
    for lengths in [[3, 2], [1, 1], [1, 0, 2]]:
        keys = ["x", "y", "z"][: len(lengths)]
        t = sum(lengths)
        experts = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(2 * t)]).reshape(2, t, 2)
        experts[0, 0, 1] = -1  # a dropped slot
        probs = torch.softmax(torch.randn(2, t, 4, generator=gen), dim=-1)
        a.record_step([1, 3], experts, probs, lengths, keys)
        for i, layer in enumerate([1, 3]):
            b.record_routing(layer, experts[i], probs[i], lengths, keys)
    ca, cb = a.counts(), b.counts()
    for key in ("tokens", "switches", "pairs", "distinct_sum", "hit_sum", "steps"):
        assert ca[key] == cb[key], key
    assert ca["entropy_sum"] == pytest.approx(cb["entropy_sum"])
    assert ca["pairs"] == [7.0, 7.0]  # x: 2 + 1 + 1 pairs, y: 1 + 1 + 0, z (new in step 3): 1
