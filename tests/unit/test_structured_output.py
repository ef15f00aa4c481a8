"""Structured output (router_service/structured_output.py, grammar_mask.py, the batcher's masked steps) on the
embedded model, whose unconstrained text is nowhere near JSON: constrained outputs parse and validate, regex and
choice outputs match, refusals are 400s naming the field, the mask is right bit for bit, and an unconstrained
greedy sequence batched with constrained ones is unchanged. No Ray."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.tokenizer import load_tokenizer
from expertmesh.ops.fake_cuda import FakeCudaTensor, fake_cuda
from expertmesh.router_service import structured_output
from expertmesh.router_service.batching import ContinuousBatcher, GenerationRequest, TokenEvent
from expertmesh.router_service.grammar_mask import TokenGrammar, allowed, grammar_tokenizer, mask_logits
from expertmesh.router_service.openai_api import OpenAIError, parse_chat, parse_completion
from expertmesh.router_service.sampling import SamplingParams

MODEL = "m"
EOS = 1
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL_DIR)


@pytest.fixture(scope="module")
def llg(tokenizer):
    return grammar_tokenizer(tokenizer.to_str(), 2048, EOS)


@pytest.fixture(scope="module")
def model():
    return load_reference_model(EMBEDDED_MODEL_DIR)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "x"}]} | fields


# ---- request fields -> constraint ------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "kind", "param"), [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     "json_schema", "response_format"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", "structured_outputs.json"),
    ({"structured_outputs": {"regex": REGEX}}, "regex", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": CHOICES}}, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object"),
    ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}}, "grammar", "structured_outputs.grammar"),
    ({"guided_json": SCHEMA}, "json_schema", "guided_json"),
    ({"guided_regex": REGEX}, "regex", "guided_regex"),
    ({"guided_choice": CHOICES}, "choice", "guided_choice"),
    ({"guided_grammar": 'start: "a"+'}, "grammar", "guided_grammar"),
])
def test_every_spelling_gives_its_constraint_on_both_endpoints(fields, kind, param):
    for job in (parse_chat(chat(**fields), MODEL), parse_completion({"model": MODEL, "prompt": "x"} | fields, MODEL)):
        assert job.constraint is not None
        assert (job.constraint.kind, job.constraint.param) == (kind, param)


def test_text_format_and_no_fields_mean_no_constraint():
    assert parse_chat(chat(response_format={"type": "text"}), MODEL).constraint is None
    assert parse_chat(chat(), MODEL).constraint is None


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "bogus"}}}}, "response_format", "bogus"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format", "nowhere"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(?=a)b"}}}}, "response_format", "look-around"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "objec"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "list"),
    ({"structured_outputs": {"choice": ["a", 3]}}, "structured_outputs.choice", "list"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": "json"}, "structured_outputs", "object"),
    ({"guided_json": "{not json"}, "guided_json", "JSON schema"),
    ({"guided_grammar": "start: (("}, "guided_grammar", "grammar"),
    ({"guided_regex": REGEX, "guided_choice": CHOICES}, "guided_choice", "only one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex",
     "only one"),
])
def test_unsupported_or_malformed_constraints_are_400s_naming_the_field(fields, param, says):
    with pytest.raises(OpenAIError) as info:
        parse_chat(chat(**fields), MODEL)
    error = info.value
    assert error.status == 400 and error.param == param, error.body()
    assert says in error.message, error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


# ---- the mask, pure ----------------------------------------------------------------------------------------------

def test_allowed_reads_bit_t_of_byte_t_over_8_little_endian():
    mask = bytes([0b00000101, 0b10000000])  # tokens 0, 2 and 15
    got = allowed(mask, 20)
    assert got.dtype == torch.bool and got.shape == (20,)
    assert got.nonzero().flatten().tolist() == [0, 2, 15]  # 16..19 past the mask's end: not allowed
    assert allowed(mask, 3).tolist() == [True, False, True]


def test_mask_logits_sets_forbidden_to_minus_inf_and_leaves_the_input():
    logits = torch.arange(10, dtype=torch.float32)
    before = logits.clone()
    out = mask_logits(logits, bytes([0b00100010, 0]))  # tokens 1 and 5
    assert torch.equal(logits, before)
    assert out[1] == 1 and out[5] == 5 and int(torch.argmax(out)) == 5
    assert torch.isinf(out[[0, 2, 3, 4, 6, 7, 8, 9]]).all()


def test_mask_logits_on_a_cuda_router_stays_on_the_device_without_reading_it():
    # The fake-CUDA double (ops/fake_cuda/) raises where CUDA would on a host tensor mixed into the unpacking, and
    # counts device reads: the mask must need none (experts/device_rule.py).
    logits = torch.arange(10, dtype=torch.float32)
    want = mask_logits(logits, bytes([0b00100010, 0]))
    with fake_cuda() as fc:
        on_device = logits.to("cuda")
        with fc.counting() as counts:
            out = mask_logits(on_device, bytes([0b00100010, 0]))
        assert isinstance(out, FakeCudaTensor) and out.device == torch.device("cuda", 0)
        assert counts.host_reads == 0 and counts.syncs == 0
        assert torch.equal(out._elem, want)


def test_the_grammar_mask_allows_exactly_the_tokens_that_continue_the_regex(llg, tokenizer):
    state = TokenGrammar(llg, structured_output.compile_constraint("r", "regex", "[0-9]+x").grammar).start()
    ok = allowed(state.bitmask(), 2048).nonzero().flatten().tolist()
    assert ok
    for token in ok:  # every allowed token decodes to digits, maybe ending in x
        assert re.fullmatch(r"[0-9]+x?", tokenizer.decode([token])), tokenizer.decode([token])
    assert EOS not in ok  # the grammar does not accept yet
    state.consume(tokenizer.encode("7").ids[0])
    x = tokenizer.encode("x").ids
    assert len(x) == 1 and allowed(state.bitmask(), 2048)[x[0]]
    state.consume(x[0])
    assert state.stopped and not state.error  # complete: nothing may follow


# ---- the batcher: constrained sequences on the embedded model ----------------------------------------------------

async def _collect(stream) -> tuple[list[int], str, str]:
    ids, text, reason = [], "", None
    async for event in stream:
        if isinstance(event, TokenEvent):
            ids.extend(event.token_ids)
            text += event.text
        else:
            reason = event.finish_reason
    return ids, text, reason


def _run(model, tokenizer, requests):
    async def main():
        batcher = ContinuousBatcher(model, tokenizer.decode)
        return await asyncio.wait_for(asyncio.gather(*(_collect(batcher.stream(r)) for r in requests)), 120)

    return asyncio.run(main())


def _request(tokenizer, prompt: str, grammar: TokenGrammar | None, max_tokens: int, temperature=0.0, seed=None):
    return GenerationRequest(prompt_ids=tokenizer.encode(prompt).ids, max_tokens=max_tokens, eos_token_id=EOS,
                             sampling=SamplingParams(temperature=temperature, seed=seed), grammar=grammar)


def _greedy_loop(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    cache, out = model.new_cache(), []
    logits = model.forward([torch.tensor(prompt_ids)], [cache])[0][-1]
    while len(out) < max_tokens:
        out.append(int(torch.argmax(logits)))
        if out[-1] == EOS:
            break
        logits = model.forward([torch.tensor([out[-1]])], [cache])[0][-1]
    return out


def test_constrained_outputs_follow_their_grammars_and_a_free_neighbour_is_unchanged(model, tokenizer, llg):
    def grammar(kind, value):
        return TokenGrammar(llg, structured_output.compile_constraint("p", kind, value).grammar)

    schema, regex, choice = grammar("json", SCHEMA), grammar("regex", REGEX), grammar("choice", CHOICES)
    free_prompt = "Once upon a time"
    requests = [
        _request(tokenizer, "Once upon a time", schema, 60),  # greedy
        _request(tokenizer, "The data", schema, 60, temperature=1.0, seed=5),
        _request(tokenizer, "import", regex, 12),
        _request(tokenizer, "while", regex, 12, temperature=1.0, seed=2),
        _request(tokenizer, "The review was", choice, 8),
        _request(tokenizer, "class", choice, 8, temperature=1.0, seed=9),
        _request(tokenizer, free_prompt, None, 12),
    ]
    results = _run(model, tokenizer, requests)
    for _ids, text, reason in results[:2]:
        assert reason == "stop", text  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(text), SCHEMA)
    for _ids, text, reason in results[2:4]:
        assert reason == "stop" and re.fullmatch(REGEX, text), text
    for _ids, text, reason in results[4:6]:
        assert reason == "stop" and text in CHOICES, text
    free_ids, free_text, _ = results[6]
    assert free_ids == _greedy_loop(model, tokenizer.encode(free_prompt).ids, 12)
    assert not free_text.lstrip().startswith("{")  # what the model writes unconstrained: not JSON


def test_json_object_gives_an_object_and_stops_there(model, tokenizer, llg):
    grammar = TokenGrammar(llg, structured_output.compile_constraint("p", "json_object", True).grammar)
    ((_, text, reason),) = _run(model, tokenizer, [_request(tokenizer, "The data", grammar, 40, 1.0, seed=3)])
    assert reason == "stop" and isinstance(json.loads(text), dict), text


def test_a_constrained_sequence_resumed_after_failover_continues_as_the_uninterrupted_one(model, tokenizer, llg):
    # The batcher replays the resumed tokens into the matcher (batching._resume), so the masks after the resume
    # are the uninterrupted run's and the seeded draws pick the same tokens.
    grammar = TokenGrammar(llg, structured_output.compile_constraint("p", "json", SCHEMA).grammar)
    request = _request(tokenizer, "The data", grammar, 60, temperature=1.0, seed=5)
    ((ids, text, reason),) = _run(model, tokenizer, [request])
    assert reason == "stop" and len(ids) > 6
    resumed = GenerationRequest(**{**request.__dict__, "resumed_ids": tuple(ids[:6])})
    ((rest, _, rest_reason),) = _run(model, tokenizer, [resumed])
    assert rest == ids[6:] and rest_reason == "stop"
