"""gpt-oss's router (`route_topk_softmax`: top-k on the biased logits, softmax over the k) against transformers'
GptOssTopKRouter, and how capacity and degraded re-routing treat it."""

from __future__ import annotations

import torch

from expertmesh.experts.gating import DROPPED, degrade, route, route_topk_softmax


def _router(experts: int = 8, hidden: int = 16, top_k: int = 3, seed: int = 0):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = GptOssConfig(hidden_size=hidden, num_local_experts=experts, num_experts_per_tok=top_k)
    router = GptOssTopKRouter(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=gen))
        router.bias.copy_(torch.randn(experts, generator=gen) * 2)
    return router


def test_matches_transformers_router_exactly():
    router = _router()
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, scores, indices = router(x)
    routing = route_topk_softmax(torch.nn.functional.linear(x, router.weight, router.bias), top_k=3)
    assert torch.equal(routing.experts, indices)
    assert torch.equal(routing.weights, scores)  # same k logits in the same order: the same softmax, bit for bit
    assert torch.allclose(routing.probs, torch.softmax(logits, -1))
    # the bias matters: without it the choice differs for some token
    assert not torch.equal(route_topk_softmax(torch.nn.functional.linear(x, router.weight), 3).experts, indices)


def test_equals_softmax_then_renormalise_but_not_without_renormalising():
    logits = torch.randn(30, 8, generator=torch.Generator().manual_seed(2))
    ours = route_topk_softmax(logits, 2)
    renormalised = route(logits, 2, renormalize=True)
    assert torch.equal(ours.experts, renormalised.experts)
    assert torch.allclose(ours.weights, renormalised.weights, atol=1e-6)
    assert torch.allclose(ours.weights.sum(-1), torch.ones(30))
    assert not torch.allclose(route(logits, 2, renormalize=False).weights, ours.weights, atol=1e-3)


def test_ties_keep_the_lower_expert_first():
    routing = route_topk_softmax(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), 2)
    assert routing.experts.tolist() == [[1, 2]] and routing.weights.tolist() == [[0.5, 0.5]]


def test_capacity_moves_overflow_and_softmax_runs_over_what_found_room():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]] * 4)  # every token wants experts 0 then 1
    routing = route_topk_softmax(logits, top_k=2, capacity_factor=1.0)  # capacity ceil(4*2/4) = 2 per expert
    # rank by rank: first choices fill expert 0 then 1, second choices spill to 2 then 3
    assert routing.experts.tolist() == [[0, 2], [0, 2], [1, 3], [1, 3]]
    assert routing.rerouted == 4 and routing.dropped == 0
    expected = torch.softmax(torch.tensor([4.0, -1.0]), -1)
    assert torch.allclose(routing.weights[2], expected)
    full = route_topk_softmax(torch.tensor([[5.0, 4.0]] * 3), top_k=2, capacity_factor=0.5)  # 2 slots per expert
    assert (full.experts == DROPPED).any() and full.dropped > 0
    assert bool((full.weights[full.experts == DROPPED] == 0).all())
    assert torch.isfinite(full.weights).all()


def test_degrade_keeps_the_weights_a_softmax_over_the_new_k():
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    routing = route_topk_softmax(logits, 2)
    available = torch.ones(8, dtype=torch.bool)
    available[routing.experts[0, 0]] = False
    moved = degrade(routing, available)
    assert moved.degraded >= 1 and not bool((moved.experts == routing.experts[0, 0]).any())
    expected = torch.softmax(torch.gather(logits, 1, moved.experts), -1)
    assert torch.allclose(moved.weights, expected, atol=1e-6)
