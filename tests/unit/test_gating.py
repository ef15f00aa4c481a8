"""Top-k gating (`expertmesh.experts.gating`): softmax + top-k, tie-breaking, renormalisation and capacity."""

from __future__ import annotations

import math

import pytest
import torch

from expertmesh.experts.gating import DROPPED, Routing, preference_order, route


def _softmax_row(logits: list[float]) -> list[float]:
    exps = [math.exp(v) for v in logits]
    total = sum(exps)
    return [v / total for v in exps]


# ---------------------------------------------------------------- uncapped routing


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (4, 2), (8, 3), (16, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_softmax_topk(seed, num_experts, top_k, renormalize):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(17, num_experts, generator=gen) * 3  # continuous values: no ties
    routing = route(logits, top_k, renormalize)
    probs = torch.softmax(logits, dim=-1)
    ref_w, ref_ids = torch.topk(probs, top_k, dim=-1)  # sorted descending
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert routing.experts.dtype == torch.int64
    assert routing.weights.dtype == torch.float32
    assert routing.experts.shape == (17, top_k) and routing.weights.shape == (17, top_k)
    assert torch.equal(routing.experts, ref_ids)
    torch.testing.assert_close(routing.weights, ref_w, rtol=0, atol=1e-6)
    assert routing.rerouted == 0 and routing.dropped == 0
    assert routing.num_tokens == 17


def test_renormalize_sums_to_one_and_raw_probs_do_not():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(32, 8, generator=gen)
    renorm = route(logits, 2, renormalize=True)
    raw = route(logits, 2, renormalize=False)
    torch.testing.assert_close(renorm.weights.sum(-1), torch.ones(32), rtol=0, atol=1e-6)
    # without renormalisation the weights are exactly the softmax probabilities of the chosen experts
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(raw.weights, torch.gather(probs, 1, raw.experts), rtol=0, atol=0)
    assert bool((raw.weights.sum(-1) < 1 - 1e-3).all())  # 2 of 8 experts never hold all the mass here
    assert torch.equal(renorm.experts, raw.experts)


def test_pinned_small_example():
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 1.0]])
    routing = route(logits, 2, renormalize=False)
    assert routing.experts.tolist() == [[2, 1], [0, 2]]
    p = _softmax_row([0.0, 1.0, 2.0])  # both rows are permutations of the same logits
    expected = torch.tensor([[p[2], p[1]], [p[2], p[1]]])
    torch.testing.assert_close(routing.weights, expected, rtol=0, atol=1e-6)
    renorm = route(logits, 2, renormalize=True)
    s = p[2] + p[1]
    torch.testing.assert_close(renorm.weights, torch.tensor([[p[2] / s, p[1] / s]] * 2), rtol=0, atol=1e-6)


def test_top_k_equal_to_num_experts_renormalized_is_full_softmax():
    logits = torch.tensor([[0.5, -1.0, 2.0]])
    routing = route(logits, 3, renormalize=True)
    assert routing.experts.tolist() == [[2, 0, 1]]
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(1), rtol=0, atol=1e-6)


def test_half_precision_logits_give_float32_weights():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.float16)
    routing = route(logits, 2, renormalize=False)
    assert routing.weights.dtype == torch.float32
    assert routing.experts.tolist() == [[3, 2]]


# ---------------------------------------------------------------- ties


def test_all_zero_logits_pick_lowest_ids():
    routing = route(torch.zeros(3, 4), 2, renormalize=True)
    assert routing.experts.tolist() == [[0, 1]] * 3
    torch.testing.assert_close(routing.weights, torch.full((3, 2), 0.5), rtol=0, atol=0)
    raw = route(torch.zeros(3, 4), 2, renormalize=False)
    torch.testing.assert_close(raw.weights, torch.full((3, 2), 0.25), rtol=0, atol=0)


def test_ties_in_the_middle_keep_lower_id_first():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, 3.0, 1.0, 3.0]])
    assert preference_order(torch.softmax(logits, -1)).tolist() == [[1, 2, 0, 3], [0, 1, 2, 3], [1, 3, 2, 0]]
    assert route(logits, 2, renormalize=True).experts.tolist() == [[1, 2], [0, 1], [1, 3]]


def test_tie_breaking_is_deterministic_for_many_tied_experts():
    # torch.topk makes no promise among ties; route must, whatever the size
    logits = torch.zeros(5, 64)
    logits[:, 40] = 1.0
    routing = route(logits, 4, renormalize=False)
    assert routing.experts.tolist() == [[40, 0, 1, 2]] * 5


def test_preference_order_is_a_permutation_sorted_by_prob():
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(10, 7, generator=gen), -1)
    order = preference_order(probs)
    assert torch.equal(order.sort(-1).values, torch.arange(7).expand(10, 7))
    ordered = torch.gather(probs, 1, order)
    assert bool((ordered[:, :-1] >= ordered[:, 1:]).all())


# ---------------------------------------------------------------- capacity


@pytest.mark.parametrize("seed", range(3))
def test_capacity_none_never_drops_or_reroutes(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, 4, generator=gen)
    logits[:, 0] += 10  # everyone wants expert 0: still no capacity, so no rerouting
    routing = route(logits, 2, renormalize=True, capacity_factor=None)
    assert routing.rerouted == 0 and routing.dropped == 0
    assert bool((routing.experts[:, 0] == 0).all())
    assert routing.tokens_per_expert(4)[0].item() == 64


def test_capacity_pinned_example_k1():
    # E=4, k=1, T=4, capacity_factor=1 -> capacity ceil(1 * 4 * 1 / 4) = 1 slot per expert.
    rows = [[3.0, 2.0, 1.0, 0.0]] * 3 + [[3.0, 0.0, 1.0, 2.0]]
    logits = torch.tensor(rows)
    routing = route(logits, 1, renormalize=False, capacity_factor=1.0)
    # every token prefers expert 0; tokens in order: t0 gets 0, t1 its 2nd choice 1, t2 its 3rd choice 2,
    # t3 (prefs 0, 3, 2, 1) its 2nd choice 3.
    assert routing.experts.tolist() == [[0], [1], [2], [3]]
    assert routing.rerouted == 3
    assert routing.dropped == 0
    p = _softmax_row(rows[0])
    q = _softmax_row(rows[3])
    torch.testing.assert_close(routing.weights, torch.tensor([[p[0]], [p[1]], [p[2]], [q[3]]]), rtol=0, atol=1e-6)
    renorm = route(logits, 1, renormalize=True, capacity_factor=1.0)
    assert torch.equal(renorm.experts, routing.experts)
    torch.testing.assert_close(renorm.weights, torch.ones(4, 1), rtol=0, atol=1e-6)
    assert routing.tokens_per_expert(4).tolist() == [1, 1, 1, 1]


def test_capacity_pinned_example_k2_fills_rank_by_rank():
    # E=3, k=2, T=3, cf=1 -> capacity ceil(3*2/3) = 2. All tokens prefer 0 > 1 > 2.
    # rank 0: t0->0, t1->0, t2->1 (0 full). rank 1: t0->1 (1 now full), t1->2, t2->2.
    row = [2.0, 1.0, 0.0]
    routing = route(torch.tensor([row] * 3), 2, renormalize=True, capacity_factor=1.0)
    assert routing.experts.tolist() == [[0, 1], [0, 2], [1, 2]]
    assert routing.rerouted == 2  # t1's and t2's expert 2 are outside their uncapped top-2 {0, 1}
    assert routing.dropped == 0
    p = _softmax_row(row)
    expected = torch.tensor([
        [p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1])],
        [p[0] / (p[0] + p[2]), p[2] / (p[0] + p[2])],
        [p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])],
    ])
    torch.testing.assert_close(routing.weights, expected, rtol=0, atol=1e-6)
    assert routing.tokens_per_expert(3).tolist() == [2, 2, 2]


def test_capacity_counts_rerouted_within_top_k_as_not_rerouted():
    # t2's first slot moves to its 2nd choice (1), which is still within its uncapped top-2: not "rerouted".
    row = [2.0, 1.0, 0.0]
    routing = route(torch.tensor([row] * 3), 2, renormalize=False, capacity_factor=1.0)
    assert routing.experts[2].tolist() == [1, 2]
    assert routing.rerouted == 2


def test_dropped_slots_k1():
    # E=2, k=1, T=4, cf=0.25 -> capacity max(1, ceil(0.5)) = 1: total capacity 2 < 4 slots.
    row = [1.0, 0.0]
    routing = route(torch.tensor([row] * 4), 1, renormalize=False, capacity_factor=0.25)
    assert routing.experts.tolist() == [[0], [1], [DROPPED], [DROPPED]]
    assert DROPPED == -1
    assert routing.dropped == 2
    assert routing.rerouted == 1
    p = _softmax_row(row)
    torch.testing.assert_close(routing.weights, torch.tensor([[p[0]], [p[1]], [0.0], [0.0]]), rtol=0, atol=1e-6)
    renorm = route(torch.tensor([row] * 4), 1, renormalize=True, capacity_factor=0.25)
    assert renorm.weights.tolist() == [[1.0], [1.0], [0.0], [0.0]]  # an all-dropped token gets 0, not nan
    assert routing.tokens_per_expert(2).tolist() == [1, 1]


def test_dropped_slots_k2_renormalize_over_survivors():
    # E=2, k=2, T=3, cf=0.5 -> capacity ceil(0.5*3*2/2) = 2; total 4 < 6 slots.
    # rank 0: t0->0, t1->0, t2->1. rank 1: t0->1 (1 full), t1 dropped, t2 dropped (0 full, 1 taken).
    row = [1.0, 0.0]
    logits = torch.tensor([row] * 3)
    routing = route(logits, 2, renormalize=True, capacity_factor=0.5)
    assert routing.experts.tolist() == [[0, 1], [0, DROPPED], [1, DROPPED]]
    assert routing.dropped == 2
    assert routing.rerouted == 0
    p = _softmax_row(row)
    torch.testing.assert_close(
        routing.weights, torch.tensor([[p[0], p[1]], [1.0, 0.0], [1.0, 0.0]]), rtol=0, atol=1e-6
    )
    raw = route(logits, 2, renormalize=False, capacity_factor=0.5)
    torch.testing.assert_close(raw.weights, torch.tensor([[p[0], p[1]], [p[0], 0.0], [p[1], 0.0]]), rtol=0, atol=1e-6)
    assert routing.tokens_per_expert(2).tolist() == [2, 2]
    assert routing.tokens_per_expert(4).tolist() == [2, 2, 0, 0]


def test_capacity_is_at_least_one():
    # cf tiny -> ceil(...) = 1 anyway (max(1, ...)): each expert still takes one slot.
    routing = route(torch.zeros(3, 3), 1, renormalize=False, capacity_factor=1e-9)
    assert routing.experts.tolist() == [[0], [1], [2]]
    assert routing.dropped == 0


def test_generous_capacity_equals_uncapped():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(20, 6, generator=gen)
    uncapped = route(logits, 2, renormalize=True)
    capped = route(logits, 2, renormalize=True, capacity_factor=100.0)
    assert torch.equal(capped.experts, uncapped.experts)
    torch.testing.assert_close(capped.weights, uncapped.weights, rtol=0, atol=0)
    assert capped.rerouted == 0 and capped.dropped == 0


@pytest.mark.parametrize("seed", range(40))
def test_capacity_property(seed):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = int(torch.randint(1, 40, (1,), generator=gen))
    num_experts = int(torch.randint(2, 9, (1,), generator=gen))
    top_k = int(torch.randint(1, num_experts + 1, (1,), generator=gen))
    cf = [0.3, 0.5, 0.8, 1.0, 1.25, 2.0][seed % 6]
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    logits[:, seed % num_experts] += 3  # a popular expert, so capacity binds
    renormalize = seed % 2 == 0
    routing = route(logits, top_k, renormalize=renormalize, capacity_factor=cf)
    capacity = max(1, math.ceil(cf * num_tokens * top_k / num_experts))

    experts = routing.experts
    assert experts.shape == (num_tokens, top_k)
    load = routing.tokens_per_expert(num_experts)
    assert int(load.max()) <= capacity
    assert int(load.sum()) + routing.dropped == num_tokens * top_k
    assert int((experts == DROPPED).sum()) == routing.dropped
    # a slot is dropped only when every expert it could still use is full
    if routing.dropped:
        for t in range(num_tokens):
            if (experts[t] == DROPPED).any():
                others = set(range(num_experts)) - set(experts[t].tolist())
                assert all(int(load[e]) == capacity for e in others)
    # per token: distinct experts; dropped slots weigh 0
    for t in range(num_tokens):
        real = [e for e in experts[t].tolist() if e != DROPPED]
        assert len(real) == len(set(real))
    assert bool((routing.weights[experts == DROPPED] == 0).all())
    # weights: the chosen experts' probabilities (renormalised over the kept slots)
    probs = torch.softmax(logits, -1)
    expect = torch.where(experts == DROPPED, 0.0, torch.gather(probs, 1, experts.clamp(min=0)))
    if renormalize:
        kept = (experts != DROPPED).any(-1)
        expect[kept] = expect[kept] / expect[kept].sum(-1, keepdim=True)
    torch.testing.assert_close(routing.weights, expect, rtol=0, atol=1e-6)
    # rerouted counts kept slots outside the uncapped top-k
    top = route(logits, top_k, renormalize=False).experts
    rerouted = sum(e != DROPPED and e not in top[t].tolist() for t in range(num_tokens) for e in experts[t].tolist())
    assert routing.rerouted == rerouted
    # determinism
    again = route(logits.clone(), top_k, renormalize=renormalize, capacity_factor=cf)
    assert torch.equal(again.experts, experts) and again.rerouted == routing.rerouted


def test_distinct_experts_uncapped_random():
    gen = torch.Generator().manual_seed(9)
    routing = route(torch.randn(50, 8, generator=gen), 4, renormalize=True)
    for row in routing.experts.tolist():
        assert len(set(row)) == 4


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, -0.5, float("nan"), float("inf"), float("-inf")])
def test_invalid_capacity_factor_raises(bad):
    with pytest.raises(ValueError, match="capacity_factor"):
        route(torch.zeros(4, 4), 2, renormalize=True, capacity_factor=bad)


@pytest.mark.parametrize("top_k", [0, 5])
def test_invalid_top_k_rejected(top_k):
    with pytest.raises(AssertionError):
        route(torch.zeros(2, 4), top_k, renormalize=True)


# ---------------------------------------------------------------- Routing


def test_tokens_per_expert_counts_slots_and_skips_dropped():
    routing = Routing(
        experts=torch.tensor([[0, 2], [2, DROPPED], [3, 0]]),
        weights=torch.zeros(3, 2),
    )
    assert routing.tokens_per_expert(5).tolist() == [2, 0, 2, 1, 0]
    assert routing.tokens_per_expert(5).dtype == torch.int64
    assert routing.num_tokens == 3
    assert routing.rerouted == 0 and routing.dropped == 0


def test_tokens_per_expert_all_dropped_is_zeros():
    routing = Routing(experts=torch.full((2, 1), DROPPED), weights=torch.zeros(2, 1), dropped=2)
    assert routing.tokens_per_expert(3).tolist() == [0, 0, 0]


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_zero_tokens(capacity_factor):
    routing = route(torch.zeros(0, 4), 2, renormalize=True, capacity_factor=capacity_factor)
    assert routing.experts.shape == (0, 2) and routing.weights.shape == (0, 2)
    assert routing.experts.dtype == torch.int64
    assert routing.num_tokens == 0 and routing.tokens_per_expert(4).tolist() == [0, 0, 0, 0]
