"""Logit rules (`sampling.adjust_logits`): logit_bias, min_tokens suppression, repetition / frequency / presence
penalties, each against logits computed by hand with vLLM's / OpenAI's formulas; validation names the field."""

from __future__ import annotations

import math

import pytest
import torch

from expertmesh.router_service.errors import RequestError
from expertmesh.router_service.sampling import SamplingParams, adjust_logits, sample_next

LOGITS = torch.tensor([2.0, -1.0, 0.5, 0.0, 3.0, -2.5])  # [V = 6]


def test_no_rule_returns_the_logits_untouched():
    assert adjust_logits(LOGITS, SamplingParams(), [1, 2], [3]) is LOGITS


def test_logit_bias_adds_to_the_named_tokens():
    got = adjust_logits(LOGITS, SamplingParams(logit_bias=((1, 5.0), (4, -100.0))), [0], [])
    assert got.tolist() == [2.0, 4.0, 0.5, 0.0, -97.0, -2.5]
    assert LOGITS.tolist() == [2.0, -1.0, 0.5, 0.0, 3.0, -2.5]  # the input is not modified


def test_suppressed_ids_become_minus_infinity():
    got = adjust_logits(LOGITS, SamplingParams(), [0], [], suppress_ids=frozenset({4, 0}))
    assert got.tolist() == [-math.inf, -1.0, 0.5, 0.0, -math.inf, -2.5]
    assert sample_next(got, SamplingParams()) == 2  # greedy now picks the best unsuppressed token


def test_repetition_penalty_divides_positive_and_multiplies_non_positive_logits_of_prompt_and_output():
    # prompt has 0 (2.0 > 0) and 1 (-1.0 ≤ 0); output has 3 (0.0) and 0 again; 2, 4, 5 never seen.
    got = adjust_logits(LOGITS, SamplingParams(repetition_penalty=2.0), [0, 1], [3, 0])
    assert got.tolist() == [1.0, -2.0, 0.5, 0.0, 3.0, -2.5]


def test_frequency_and_presence_penalties_count_only_the_output():
    # output: token 4 twice, token 2 once; prompt token 0 is not penalised.
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = adjust_logits(LOGITS, params, [0, 0, 0], [4, 2, 4])
    expected = [2.0, -1.0, 0.5 - 0.5 * 1 - 0.25, 0.0, 3.0 - 0.5 * 2 - 0.25, -2.5]
    assert got.tolist() == pytest.approx(expected, abs=0, rel=0)


def test_negative_penalties_encourage_repeats():
    got = adjust_logits(LOGITS, SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0), [], [5, 5])
    assert got.tolist() == [2.0, -1.0, 0.5, 0.0, 3.0, -2.5 + 2.0 + 2.0]


def test_rules_apply_in_vllms_order_bias_then_suppression_then_penalties():
    # bias makes token 1 positive (-1 + 3 = 2), then repetition halves it (it is in the prompt); frequency then
    # subtracts per output occurrence; token 4 is suppressed whatever its bias.
    params = SamplingParams(logit_bias=((1, 3.0), (4, 10.0)), repetition_penalty=2.0, frequency_penalty=1.0)
    got = adjust_logits(LOGITS, params, [1], [1, 2], suppress_ids=frozenset({4}))
    assert got.tolist() == [2.0, 2.0 / 2 - 1.0, 0.5 / 2 - 1.0, 0.0, -math.inf, -2.5]


def test_greedy_with_a_penalty_avoids_the_repeated_token():
    logits = torch.tensor([1.0, 1.2, 0.0])
    assert sample_next(logits, SamplingParams()) == 1
    adjusted = adjust_logits(logits, SamplingParams(presence_penalty=0.5), [], [1])
    assert sample_next(adjusted, SamplingParams()) == 0


def test_float64_and_batched_devices_keep_dtype_and_device():
    logits = LOGITS.double()
    got = adjust_logits(logits, SamplingParams(frequency_penalty=1.0, logit_bias=((0, 1.0),)), [], [0])
    assert got.dtype == torch.float64 and got.device == logits.device
    assert got.tolist() == [2.0, -1.0, 0.5, 0.0, 3.0, -2.5]


@pytest.mark.parametrize("kwargs,field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=math.nan), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(logit_bias=((3, 101.0),)), "logit_bias"),
    (dict(logit_bias=((3, math.nan),)), "logit_bias"),
    (dict(logit_bias=((6, 1.0),)), "logit_bias"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
])
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs).validate(vocab_size=6)
    assert info.value.field == field


def test_valid_rules_pass():
    params = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.3,
                            logit_bias=((0, -100.0), (5, 100.0)))
    assert params.validate(vocab_size=6) is params and params.adjusts_logits
    assert not SamplingParams().adjusts_logits
