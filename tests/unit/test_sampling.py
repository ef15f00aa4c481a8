"""Next-token choice (`expertmesh.router_service.sampling`): parameter validation, greedy, temperature, top-k, top-p
and per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch

from expertmesh.router_service.router import RequestError
from expertmesh.router_service.sampling import SamplingParams, sample_next, skip_draws


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [sample_next(logits, params, gen) for _ in range(n)]


def _logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=-1e-12), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=-math.inf), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_p=1.0000001), "top_p"),
    (dict(top_p=2.0), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_p=math.inf), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(seed=2**64 + 5), "seed"),
])
def test_validate_rejects_bad_field(kwargs, field):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs).validate()
    assert info.value.field == field
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still see it
    assert field in str(info.value)


def test_validate_reports_the_first_bad_field_it_checks():
    with pytest.raises(RequestError) as info:
        SamplingParams(temperature=-1, top_p=0, top_k=-1, seed=-1).validate()
    assert info.value.field == "temperature"


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(temperature=0.0),
    dict(temperature=0.7, top_p=0.9, top_k=40, seed=0),
    dict(temperature=100.0, top_p=1.0, top_k=0, seed=2**63 - 1),
    dict(top_p=1e-9),
    dict(top_k=10**6),
])
def test_validate_accepts_good_params_and_returns_self(kwargs):
    params = SamplingParams(**kwargs)
    assert params.validate() is params


def test_greedy_flag_and_generator():
    assert SamplingParams().greedy
    assert SamplingParams().generator() is None
    assert not SamplingParams(temperature=0.5).greedy
    assert isinstance(SamplingParams(temperature=0.5, seed=3).generator(), torch.Generator)
    assert isinstance(SamplingParams(temperature=0.5).generator(), torch.Generator)  # unseeded: a random seed


# ---------------------------------------------------------------- greedy and top-k = 1


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax(seed):
    logits = torch.randn(96, generator=torch.Generator().manual_seed(seed)) * 3
    expected = int(torch.argmax(logits))
    assert sample_next(logits, SamplingParams()) == expected
    # greedy ignores top-k / top-p and needs no generator
    assert sample_next(logits, SamplingParams(top_k=5, top_p=0.3)) == expected


def test_greedy_returns_a_python_int():
    token = sample_next(torch.tensor([0.1, 3.0, -2.0]), SamplingParams())
    assert type(token) is int and token == 1


@pytest.mark.parametrize("temperature", [1e-3, 0.5, 1.0, 2.0, 50.0, 1e6])
def test_top_k_one_is_argmax_at_any_temperature(temperature):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 2
    expected = int(torch.argmax(logits))
    draws = _draws(logits, SamplingParams(temperature=temperature, top_k=1), 200)
    assert set(draws) == {expected}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0])
def test_tiny_top_p_keeps_only_the_best_token(temperature):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(2))
    expected = int(torch.argmax(logits))
    draws = _draws(logits, SamplingParams(temperature=temperature, top_p=1e-6), 300)
    assert set(draws) == {expected}


# ---------------------------------------------------------------- top-k


@pytest.mark.parametrize("k", [2, 3, 7])
def test_top_k_never_samples_outside_the_k_best(k):
    gen = torch.Generator().manual_seed(10 + k)
    logits = torch.randn(50, generator=gen) * 0.3  # flat: without the cut every token would turn up
    best = set(torch.topk(logits, k).indices.tolist())
    draws = _draws(logits, SamplingParams(temperature=1.0, top_k=k), 1500)
    assert set(draws) <= best
    assert set(draws) == best  # and every one of the k best does turn up


def test_top_k_larger_than_vocab_is_plain_sampling():
    logits = torch.zeros(4)
    draws = _draws(logits, SamplingParams(temperature=1.0, top_k=100), 400)
    assert set(draws) == {0, 1, 2, 3}


# ---------------------------------------------------------------- top-p


@pytest.mark.parametrize("top_p,allowed", [
    (0.5, {0}),
    (0.8, {0, 1}),
    (0.81, {0, 1, 2}),
    (0.95, {0, 1, 2}),
    (0.96, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p, allowed):
    logits = _logits_from_probs([0.5, 0.3, 0.15, 0.05])
    draws = _draws(logits, SamplingParams(temperature=1.0, top_p=top_p), 1500)
    assert set(draws) == allowed


def test_top_p_works_on_the_sorted_order_not_the_token_order():
    # same distribution, permuted: token 3 is the best, then 0, then 2, then 1
    logits = _logits_from_probs([0.3, 0.05, 0.15, 0.5])
    draws = _draws(logits, SamplingParams(temperature=1.0, top_p=0.8), 1500)
    assert set(draws) == {3, 0}


def test_top_p_renormalises_the_kept_mass():
    logits = _logits_from_probs([0.5, 0.3, 0.15, 0.05])
    n = 6000
    draws = _draws(logits, SamplingParams(temperature=1.0, top_p=0.8), n, seed=4)
    freq0 = draws.count(0) / n
    assert abs(freq0 - 0.5 / 0.8) < 0.025  # ~4 standard deviations


def test_top_k_and_top_p_combine():
    logits = _logits_from_probs([0.4, 0.3, 0.2, 0.1])
    # top_k=3 leaves [0.4, 0.3, 0.2] / 0.9; top_p=0.7 of that keeps 0.444 + 0.333 = 0.777 -> tokens 0, 1
    draws = _draws(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7), 1500)
    assert set(draws) == {0, 1}


# ---------------------------------------------------------------- seeds and distribution


def test_same_seed_same_draws_different_seed_different_draws():
    logits = torch.randn(96, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, seed=1234)
    gen_a = params.generator()
    a = [sample_next(logits, params, gen_a) for _ in range(200)]
    gen_b = params.generator()
    b = [sample_next(logits, params, gen_b) for _ in range(200)]
    assert a == b
    other = SamplingParams(temperature=1.0, seed=1235)
    gen_c = other.generator()
    c = [sample_next(logits, other, gen_c) for _ in range(200)]
    assert a != c


def test_draws_advance_the_generator():
    logits = torch.zeros(96)
    draws = _draws(logits, SamplingParams(temperature=1.0), 50)
    assert len(set(draws)) > 10  # not the same token over and over


def test_frequencies_at_temperature_one_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    probs = torch.softmax(logits, -1)
    n = 20_000
    counts = torch.bincount(torch.tensor(_draws(logits, SamplingParams(temperature=1.0), n, seed=7)),
                            minlength=logits.numel()).double()
    freq = counts / n
    assert float((freq - probs.double()).abs().max()) < 0.02
    # chi-square, 6 degrees of freedom: the 99.9 % quantile is 22.46
    expected = probs.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 22.46


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_frequencies_at_other_temperatures_match_scaled_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    probs = torch.softmax(logits / temperature, -1)
    n = 8000
    freq = torch.bincount(torch.tensor(_draws(logits, SamplingParams(temperature=temperature), n, seed=8)),
                          minlength=4).double() / n
    assert float((freq - probs.double()).abs().max()) < 0.02


def test_lower_temperature_puts_more_mass_on_the_argmax():
    logits = torch.tensor([1.0, 0.6, 0.3, 0.0, -0.4])
    n = 2000
    share = {t: _draws(logits, SamplingParams(temperature=t), n, seed=9).count(0) / n for t in (2.0, 1.0, 0.5, 0.1)}
    assert share[2.0] < share[1.0] < share[0.5] < share[0.1]
    assert share[0.1] > 0.95


# ---------------------------------------------------------------- source bugs pinned (fixed since)


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 1e-300])
def test_tiny_positive_temperature_behaves_like_greedy(temperature):
    # Dividing raw float32 logits by a tiny temperature overflowed to inf and softmax turned NaN (multinomial raised).
    params = SamplingParams(temperature=temperature).validate()
    for seed in range(5):
        logits = torch.randn(96, generator=torch.Generator().manual_seed(seed)) * 3
        expected = int(torch.argmax(logits))
        assert _draws(logits, params, 20, seed=seed) == [expected] * 20
    # large logits of both signs too
    logits = torch.tensor([-1e30, 3e38, 2.9e38, -3e38, 0.0])
    assert _draws(logits, params, 10) == [1] * 10


# ---------------------------------------------------------------- resuming after k steps (router failover)


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_sampling_draws_what_torch_multinomial_drew_so_seeded_output_is_unchanged(seed):
    """The explicit exponential race picks what torch.multinomial(probs, 1) picked from the same generator, so a
    seeded request samples the same tokens as before resuming existed."""
    params = SamplingParams(temperature=0.8, seed=seed)
    logits = torch.randn(97, generator=torch.Generator().manual_seed(seed % 1000)) * 2
    probs = torch.softmax((logits.double() - logits.double().max()) / params.temperature, -1)
    ours, theirs = params.generator(), params.generator()
    for _ in range(30):
        assert sample_next(logits, params, ours) == int(torch.multinomial(probs, 1, generator=theirs))


@pytest.mark.parametrize("k", [0, 1, 5, 17])
def test_resume_after_k_steps_samples_what_the_uninterrupted_run_did(k):
    """Different logits every step (as in decoding): a generator seeded afresh and skipped past k steps samples
    steps k.. exactly as the generator that drew steps 0..k-1."""
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    steps = [torch.randn(101, generator=torch.Generator().manual_seed(100 + i)) * 2 for i in range(24)]
    whole = params.generator()
    uninterrupted = [sample_next(logits, params, whole) for logits in steps]
    resumed = params.generator()
    skip_draws(resumed, 101, k)
    assert [sample_next(logits, params, resumed) for logits in steps[k:]] == uninterrupted[k:]


def test_skip_draws_is_a_no_op_for_greedy_and_zero_steps():
    skip_draws(None, 10, 5)
    gen = torch.Generator().manual_seed(3)
    before = gen.get_state().clone()
    skip_draws(gen, 10, 0)
    assert torch.equal(gen.get_state(), before)
