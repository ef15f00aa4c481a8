"""The DeepSeek-V2 and sigmoid (DeepSeek-V3 / GLM-4.5) routers of `expertmesh.experts.gating` against
transformers' own router modules, and capacity, degrade and routing entropy with each."""

from __future__ import annotations

import math

import pytest
import torch

from expertmesh.cluster.load_stats import LoadWindow, routing_entropy
from expertmesh.experts.gating import (
    DROPPED,
    concat_routings,
    degrade,
    route_deepseek_v2,
    route_sigmoid_grouped,
)

H, E = 16, 16


def _hidden(seed: int, tokens: int = 23) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))


def _by_expert(experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, k] ids and weights -> [T, E] dense weights, so routers that order slots differently compare equal."""
    dense = torch.zeros(experts.shape[0], E)
    return dense.scatter_(1, experts, weights)


def _hf_v2_router(method: str, top_k: int, seed: int, scaling: float):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=top_k, topk_method=method,
                           n_group=4, topk_group=2, routed_scaling_factor=scaling, num_attention_heads=4)
    router = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(seed)) * 0.5)
    return router


def _hf_sigmoid_router(family: str, top_k: int, seed: int, n_group: int, topk_group: int, norm: bool,
                       scaling: float):
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config as Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router
    else:
        from transformers import Glm4MoeConfig as Config
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router
    cfg = Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=top_k, n_group=n_group,
                 topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scaling,
                 num_attention_heads=4, num_key_value_heads=4)
    router = Router(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen) * 0.5)
        router.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.3)
    return router


# ---------------------------------------------------------------- against transformers


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
@pytest.mark.parametrize("top_k", [2, 6])
def test_deepseek_v2_router_matches_transformers(seed, method, top_k):
    router = _hf_v2_router(method, top_k, seed, scaling=1.5)
    h = _hidden(seed)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(h)
    ours = route_deepseek_v2(logits, top_k, method, n_group=4, topk_group=2, routed_scaling_factor=1.5)
    assert torch.equal(ours.experts.sort(-1).values, hf_ids.sort(-1).values)
    torch.testing.assert_close(_by_expert(ours.experts, ours.weights), _by_expert(hf_ids, hf_w), rtol=0, atol=1e-7)
    torch.testing.assert_close(ours.probs, torch.softmax(logits, -1), rtol=0, atol=0)


def test_group_limited_v2_router_stays_inside_the_chosen_groups():
    h = _hidden(11, tokens=64)
    logits = _hf_v2_router("group_limited_greedy", 6, 11, 1.0)(h)[0].detach()
    greedy = route_deepseek_v2(logits, 6, "greedy")
    limited = route_deepseek_v2(logits, 6, "group_limited_greedy", n_group=4, topk_group=2)
    groups = limited.experts // (E // 4)  # [T, k] group of each chosen expert
    assert all(len(set(row)) <= 2 for row in groups.tolist())
    assert not torch.equal(greedy.experts.sort(-1).values, limited.experts.sort(-1).values)  # the limit bites


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n_group,topk_group,top_k", [(1, 1, 4), (4, 2, 4), (8, 3, 6), (4, 1, 2)])
@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_router_matches_transformers(family, seed, n_group, topk_group, top_k, norm):
    router = _hf_sigmoid_router(family, top_k, seed, n_group, topk_group, norm, scaling=2.5)
    h = _hidden(seed)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(h)
    ours = route_sigmoid_grouped(logits, top_k, router.e_score_correction_bias, n_group, topk_group, norm, 2.5)
    assert torch.equal(ours.experts.sort(-1).values, hf_ids.sort(-1).values)
    torch.testing.assert_close(_by_expert(ours.experts, ours.weights), _by_expert(hf_ids, hf_w), rtol=0, atol=1e-6)
    scores = torch.sigmoid(logits)
    torch.testing.assert_close(ours.probs, scores / scores.sum(-1, keepdim=True), rtol=0, atol=0)


def test_correction_bias_changes_selection_not_weights():
    logits = _hidden(5, tokens=40)[:, :E] * 2
    bias = torch.zeros(E)
    bias[3] = 5.0  # expert 3 is always ranked first, but weighted by its own score
    plain = route_sigmoid_grouped(logits, 2, None, norm_topk_prob=False)
    biased = route_sigmoid_grouped(logits, 2, bias, norm_topk_prob=False)
    assert bool((biased.experts == 3).any(-1).all())
    assert not bool((plain.experts == 3).any(-1).all())
    torch.testing.assert_close(biased.weights, torch.gather(torch.sigmoid(logits), 1, biased.experts))


# ---------------------------------------------------------------- capacity, degrade, entropy


@pytest.mark.parametrize("router", ["v2_limited", "sigmoid"])
def test_capacity_caps_every_expert_and_keeps_the_weights_rule(router):
    logits = _hidden(7, tokens=32)[:, :E] * 3
    logits[:, 0] += 6  # everyone's favourite
    bias = torch.linspace(0.2, -0.2, E)
    if router == "v2_limited":
        run = lambda cap: route_deepseek_v2(logits, 2, "group_limited_greedy", 4, 2, 1.5, cap)  # noqa: E731
    else:
        run = lambda cap: route_sigmoid_grouped(logits, 2, bias, 4, 2, True, 2.5, cap)  # noqa: E731
    capped, free = run(1.0), run(None)
    capacity = math.ceil(1.0 * 32 * 2 / E)
    assert int(capped.tokens_per_expert(E).max()) <= capacity
    assert int(free.tokens_per_expert(E)[0]) > capacity
    assert capped.rerouted > 0 and capped.rerouted_per_token is not None
    # generous capacity changes nothing
    roomy = run(100.0)
    assert torch.equal(roomy.experts, free.experts) and torch.equal(roomy.weights, free.weights)
    kept = capped.experts != DROPPED
    if router == "sigmoid":  # renormalised over the surviving slots, times the scaling factor
        torch.testing.assert_close(capped.weights.sum(-1)[kept.any(-1)], torch.full((int(kept.any(-1).sum()),), 2.5))
    else:  # raw softmax probabilities times the scaling factor
        expected = torch.gather(capped.probs, 1, capped.experts.clamp(min=0)) * 1.5
        torch.testing.assert_close(capped.weights[kept], expected[kept])


def test_degrade_under_sigmoid_routing_reweights_like_the_router():
    """With norm_topk_prob, a degraded token gets exactly the weights the router gives its new expert set."""
    logits = _hidden(8, tokens=20)[:, :E] * 2
    bias = torch.linspace(0.3, -0.3, E)
    routing = route_sigmoid_grouped(logits, 3, bias, 4, 2, True, 2.5)
    lost = int(routing.experts[0, 0])
    available = torch.ones(E, dtype=torch.bool)
    available[lost] = False
    out = degrade(routing, available)
    assert not bool((out.experts == lost).any())
    assert out.degraded == int((routing.experts == lost).sum())
    scores = torch.sigmoid(logits)
    chosen = torch.gather(scores, 1, out.experts)
    torch.testing.assert_close(out.weights, chosen / chosen.sum(-1, keepdim=True) * 2.5)
    # the replacement is the router's next choice: best selection score inside the token's groups
    row = routing.selection[0].clone()
    row[routing.experts[0]] = float("-inf")
    assert int(out.experts[0, 0]) == int(row.argmax())


def test_degrade_under_sigmoid_without_renormalisation_keeps_each_tokens_mass():
    logits = _hidden(9, tokens=12)[:, :E]
    routing = route_sigmoid_grouped(logits, 2, None, 1, 1, False, 1.0)
    available = torch.ones(E, dtype=torch.bool)
    available[routing.experts[:, 0].unique()] = False
    out = degrade(routing, available)
    torch.testing.assert_close(out.weights.sum(-1), routing.weights.sum(-1))
    scores = torch.gather(torch.sigmoid(logits), 1, out.experts)
    torch.testing.assert_close(out.weights[:, 0] / out.weights[:, 1], scores[:, 0] / scores[:, 1])


def test_concat_keeps_the_selection_scores():
    a = route_sigmoid_grouped(_hidden(1, 3)[:, :E], 2, None, 4, 2)
    b = route_sigmoid_grouped(_hidden(2, 4)[:, :E], 2, None, 4, 2)
    both = concat_routings([a, b])
    assert torch.equal(both.selection, torch.cat([a.selection, b.selection]))


@pytest.mark.parametrize("router", ["v2", "sigmoid"])
def test_routing_entropy_uses_the_routers_distribution(router):
    logits = _hidden(10, tokens=9)[:, :E]
    r = (route_deepseek_v2(logits, 2) if router == "v2" else route_sigmoid_grouped(logits, 2, torch.ones(E), 4, 2))
    torch.testing.assert_close(r.probs.sum(-1), torch.ones(9))
    ent = routing_entropy(r.probs)
    assert bool((ent > 0).all()) and bool((ent <= math.log(E) + 1e-6).all())
    window = LoadWindow([1], E, 2)
    window.record_routing(1, r.experts, r.probs, [9], ["seq"])
    snap = window.snapshot()
    assert snap["health"]["routing_entropy"][0] == pytest.approx(float(ent.mean()), rel=1e-5)
