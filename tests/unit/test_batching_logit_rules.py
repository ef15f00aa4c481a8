"""Logit rules served by the continuous batcher (`batching` + `sampling.adjust_logits`) on the in-process reference
model: penalties and logit_bias give the tokens of a plain loop applying the same rule, batched with other streams;
min_tokens holds off eos, stop token ids and stop strings. No Ray."""

from __future__ import annotations

import asyncio

import pytest
import torch

from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.batching import ContinuousBatcher, DoneEvent, GenerationRequest, TokenEvent
from expertmesh.router_service.sampling import SamplingParams, adjust_logits, sample_next

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def model(checkpoints):
    return load_reference_model(checkpoints["mixtral"])


def fake_decode(ids: list[int]) -> str:
    return "".join(chr(97 + i % 26) for i in ids)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def loop_with_rules(model, request: GenerationRequest) -> list[int]:
    """The slow obvious path: prefill, then per step apply the request's rules to the last logits and choose."""
    cache, gen = model.new_cache(), request.sampling.generator()
    logits = model.forward([torch.tensor(request.prompt_ids)], [cache])[0][-1]
    out: list[int] = []
    while True:
        adjusted = adjust_logits(logits, request.sampling, request.prompt_ids, out,
                                 request.suppressed_ids(len(out)))
        out.append(sample_next(adjusted, request.sampling, gen))
        if len(out) == request.max_tokens or out[-1] == request.eos_token_id or out[-1] in request.stop_token_ids:
            return out
        logits = model.forward([torch.tensor([out[-1]])], [cache])[0][-1]


async def collect(stream) -> tuple[list[int], str, DoneEvent]:
    tokens, text, done = [], "", None
    async for event in stream:
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
            text += event.text
        else:
            done = event
    return tokens, text, done


def serve_together(model, requests: list[GenerationRequest], decode=None) -> list[tuple[list[int], str, DoneEvent]]:
    async def main():
        batcher = ContinuousBatcher(model, decode)
        return await asyncio.gather(*(collect(batcher.stream(r)) for r in requests))

    async def guarded():
        return await asyncio.wait_for(main(), TIMEOUT)

    return asyncio.run(guarded())


RULES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=2.0),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(logit_bias=((5, 4.0), (7, -100.0))),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=0.7, repetition_penalty=1.3, logit_bias=((3, 2.5),)),
    SamplingParams(temperature=0.9, seed=4, frequency_penalty=1.0, repetition_penalty=1.2),
]


def test_batched_rules_equal_the_loop_applying_them(model):
    requests = [GenerationRequest(prompt_ids=prompt(5 + i, seed=900 + i), max_tokens=10, sampling=params)
                for i, params in enumerate(RULES)]
    plain = GenerationRequest(prompt_ids=prompt(6, seed=950), max_tokens=10)
    got = serve_together(model, requests + [plain])
    for request, (tokens, _, done) in zip(requests + [plain], got):
        assert tokens == loop_with_rules(model, request), request.sampling
        assert done.completion_tokens == 10
    # the rules change something: a greedy penalty-free run of the same prompts differs for most of them
    changed = sum(loop_with_rules(model, GenerationRequest(prompt_ids=r.prompt_ids, max_tokens=10)) != t
                  for r, (t, _, _) in zip(requests, got))
    assert changed >= len(RULES) - 1


def test_min_tokens_holds_off_eos_and_stop_token_ids(model):
    prompt_ids = prompt(6, seed=960)
    greedy = loop_with_rules(model, GenerationRequest(prompt_ids=prompt_ids, max_tokens=8))
    eos, stop = greedy[0], greedy[1]
    stopped_early = GenerationRequest(prompt_ids=prompt_ids, max_tokens=8, eos_token_id=eos)
    held = GenerationRequest(prompt_ids=prompt_ids, max_tokens=8, eos_token_id=eos,
                             stop_token_ids=frozenset({stop}), min_tokens=4)
    (early, _, early_done), (tokens, _, done) = serve_together(model, [stopped_early, held])
    assert early == [eos] and early_done.finish_reason == "eos"
    assert eos not in tokens[:4] and stop not in tokens[:4]
    assert tokens == loop_with_rules(model, held)
    assert len(tokens) >= 4


def test_min_tokens_holds_off_stop_strings_until_reached(model):
    prompt_ids = prompt(6, seed=970)
    tokens = loop_with_rules(model, GenerationRequest(prompt_ids=prompt_ids, max_tokens=8))
    text = fake_decode(tokens)
    stop = text[0]  # would stop at once
    later = [i for i in range(3, 8) if text[i] == stop]
    (got, got_text, done), = serve_together(
        model, [GenerationRequest(prompt_ids=prompt_ids, max_tokens=8, stop_strings=(stop,), min_tokens=3)],
        fake_decode)
    if later:  # the stop string comes again after min_tokens: it ends the text there
        assert got_text == text[:later[0]] and done.finish_reason == "stop"
    else:
        assert got_text == text and done.finish_reason == "length"
    assert got_text.startswith(text[:3])
