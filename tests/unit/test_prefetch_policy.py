"""Which predictions become prefetch hints (router_service/prefetch_policy.py) and the predictor using it
(router_service/prefetch.py): confidence from the gate's probabilities, a per-layer budget, a precision floor."""

from __future__ import annotations

import pytest
import torch

from expertmesh.router_service.config import ExpertsConfig
from expertmesh.router_service.prefetch import NextLayerPredictor
from expertmesh.router_service.prefetch_policy import (
    PROBE_EVERY,
    PrefetchPolicy,
    choose_experts,
    expert_confidence,
    precision_allows,
)

PROBS = torch.tensor([[0.6, 0.3, 0.05, 0.05],   # token 0 picks 0 (0.6) and 1 (0.3)
                      [0.1, 0.15, 0.7, 0.05]])  # token 1 picks 2 (0.7) and 1 (0.15)


def test_confidence_is_the_best_probability_among_top_k_picks():
    assert expert_confidence(PROBS, top_k=2) == pytest.approx({0: 0.6, 1: 0.3, 2: 0.7})
    assert expert_confidence(PROBS, top_k=1) == pytest.approx({0: 0.6, 2: 0.7})
    assert expert_confidence(torch.zeros(0, 4), top_k=2) == {}


def test_threshold_and_budget_keep_the_most_confident():
    conf = expert_confidence(PROBS, top_k=2)
    assert choose_experts(conf, PrefetchPolicy()) == [0, 1, 2]
    assert choose_experts(conf, PrefetchPolicy(min_confidence=0.5)) == [0, 2]
    assert choose_experts(conf, PrefetchPolicy(max_shards=1)) == [2]
    assert choose_experts(conf, PrefetchPolicy(min_confidence=0.9)) == []


def test_precision_floor_withholds_but_probes():
    policy = PrefetchPolicy(min_precision=0.5)
    assert precision_allows(0, 10, 3, policy)  # warming up: too few predictions to judge
    assert precision_allows(40, 64, 3, policy)  # 0.625 ≥ 0.5
    assert not precision_allows(10, 64, 3, policy)
    assert precision_allows(10, 64, PROBE_EVERY, policy)  # the probe keeps measuring
    assert precision_allows(0, 1000, 3, PrefetchPolicy())  # no floor


def test_predictor_hints_only_confident_experts_in_gate_mode():
    probs_seen = []

    def gate_probs(layer, hidden):
        probs_seen.append(layer)
        return PROBS

    p = NextLayerPredictor("gate", [0, 1], lambda layer, h: PROBS.topk(2).indices,
                           policy=PrefetchPolicy(min_confidence=0.5), gate_probs=gate_probs, top_k=2)
    assert p.predict(0, torch.zeros(2, 8)) == (1, [0, 2]) and probs_seen == [1]
    plain = NextLayerPredictor("gate", [0, 1], lambda layer, h: PROBS.topk(2).indices, gate_probs=gate_probs)
    assert plain.predict(0, torch.zeros(2, 8)) == (1, [0, 1, 2])  # no threshold: the gate's picks, probs unused
    assert probs_seen == [1]


def test_predictor_withholds_below_the_precision_floor():
    p = NextLayerPredictor("history", [0, 1], policy=PrefetchPolicy(min_precision=0.9))
    h = torch.zeros(1, 8)
    hinted = 0
    for step in range(40):  # layer 1 always predicted {4} and always uses {5}: precision 0
        p.observe(0, torch.tensor([[0, 1]]))
        if p.predict(0, h) is not None:
            hinted += 1
        p.observe(1, torch.tensor([[5, 6]]) if step else torch.tensor([[4, 6]]))
        p.last_used[1] = {4}
    assert p.stats()["withheld_layers"] > 0 and hinted < 40


def test_config_fields_are_checked():
    assert ExpertsConfig(prefetch_min_confidence=0.3, prefetch_max_shards=4).prefetch_policy() == PrefetchPolicy(
        0.3, 4, 0.0)
    with pytest.raises(ValueError, match="prefetch_min_confidence"):
        ExpertsConfig(prefetch_min_confidence=1.5).validate()
    with pytest.raises(ValueError, match="prefetch_max_shards"):
        ExpertsConfig(prefetch_max_shards=0).validate()
