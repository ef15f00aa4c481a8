"""Tool calls (router_service/tool_calls.py): tools / tool_choice validated with 400s naming the field; each family's
chat template (tests/unit/fixtures/chat_templates: Qwen3, DeepSeek-V3, GLM-4.5, gpt-oss) recognised, and the calls it
writes parsed back into the same names and arguments; streamed text split into content and call deltas exactly as the
whole text parses; a forced tool_choice makes the embedded model (which knows nothing of tools) emit a valid call;
responses and chunks carry OpenAI's tool_calls and finish_reason. No Ray."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest

from expertmesh.experts.config import load_model_config
from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.tokenizer import load_tokenizer
from expertmesh.router_service import openai_requests, openai_responses, tool_calls
from expertmesh.router_service.batching import ContinuousBatcher
from expertmesh.router_service.chat_template import ChatTemplate, load_chat_template
from expertmesh.router_service.grammar_mask import grammar_tokenizer
from expertmesh.router_service.openai_api import OpenAIError, parse_chat

MODEL = "m"
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
FAMILY_OF_FIXTURE = {"qwen3": "hermes", "deepseek_v3": "deepseek", "glm45": "glm45", "gpt_oss": "harmony"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}]} | fields


def template(name: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), {"bos_token": "<s>", "eos_token": "</s>"})


# ---- request fields ----------------------------------------------------------------------------------------------

def test_tool_choice_forms():
    assert parse_chat(chat(tools=TOOLS), MODEL).tools.choice == "auto"
    assert parse_chat(chat(tools=TOOLS, tool_choice="none"), MODEL).tools is None
    job = parse_chat(chat(tools=TOOLS, tool_choice="required"), MODEL)
    assert job.tools.choice == "required" and job.constraint.kind == "tool_call"
    job = parse_chat(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), MODEL)
    assert (job.tools.choice, job.tools.name) == ("named", "get_time") and job.constraint is not None
    assert parse_chat(chat(tools=TOOLS), MODEL).constraint is None  # auto: the model decides, unconstrained


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "format": "bad"}}}],
      "tool_choice": "required"}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]}, "messages[0].tool_calls"),
])
def test_bad_tools_are_400s_naming_the_field(fields, param):
    with pytest.raises(OpenAIError) as info:
        parse_chat(chat(**fields), MODEL)
    assert (info.value.status, info.value.param) == (400, param), info.value.body()


# ---- families: their templates' own calls parse back -------------------------------------------------------------

@pytest.mark.parametrize("fixture", sorted(FAMILY_OF_FIXTURE))
def test_each_family_is_recognised_from_its_template(fixture):
    assert tool_calls.family_of(template(fixture).source) == FAMILY_OF_FIXTURE[fixture]


def test_a_template_without_tool_syntax_gets_hermes():
    assert tool_calls.family_of(load_chat_template(EMBEDDED_MODEL_DIR).source) == "hermes"


def _assistant_turn(fixture: str, calls: list[tuple[str, dict]], content: str = "") -> str:
    """What the template writes for an assistant turn with these calls: the rendering with the turn, minus the
    rendering up to the generation prompt (the text a model of that family generates)."""
    tpl = template(fixture)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    turn = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for k, (name, args) in enumerate(calls)]}
    head = tpl.render(user, add_generation_prompt=True, tools=TOOLS)
    full = tpl.render(user + [turn], add_generation_prompt=False, tools=TOOLS)
    assert full.startswith(head), (head[-80:], full[len(head) - 80:])
    generated = full[len(head):]
    for end_of_turn in ("<|im_end|>\n", "<｜end▁of▁sentence｜>"):  # the eos that ends the turn: not in the text
        generated = generated.removesuffix(end_of_turn)
    return generated


ONE = [("get_weather", {"city": "Paris", "days": 2})]
TWO = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize(("fixture", "calls"), [
    ("qwen3", ONE), ("qwen3", TWO), ("deepseek_v3", ONE), ("deepseek_v3", TWO), ("glm45", ONE), ("glm45", TWO),
    ("gpt_oss", ONE),  # the published gpt-oss template renders one call per assistant message
])
def test_the_calls_a_template_writes_parse_back_to_the_same_names_and_arguments(fixture, calls):
    text = _assistant_turn(fixture, calls)
    parsed = tool_calls.parse(text, FAMILY_OF_FIXTURE[fixture], tuple(TOOLS))
    assert [(name, json.loads(args)) for name, args in parsed.calls] == calls, text
    assert all(isinstance(args, str) for _, args in parsed.calls)  # OpenAI's arguments: a JSON string
    # What is left is the turn's frame (Qwen3's empty think block, end-of-turn tokens), never a piece of a call.
    assert not any(mark in parsed.content for mark in ("tool_call", "tool▁call", "arg_key", "functions."))


def test_text_without_calls_is_all_content():
    for family in tool_calls.FAMILIES:
        parsed = tool_calls.parse("It is sunny in Paris.", family)
        assert parsed.calls == [] and parsed.content == "It is sunny in Paris."


def test_hermes_keeps_the_text_around_calls_and_takes_an_unclosed_last_call():
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'  # stopped at eos
    parsed = tool_calls.parse_hermes(text)
    assert parsed.content == "Let me check." and parsed.calls == [("get_time", '{"zone": "UTC"}')]
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool'  # max_tokens inside the tag
    assert tool_calls.parse_hermes(cut).calls == [("get_time", '{"zone": "UTC"}')]
    assert tool_calls.parse_hermes(cut).content == ""
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert tool_calls.parse_hermes(broken).calls == [] and tool_calls.parse_hermes(broken).content == broken


def test_deepseek_v31_calls_without_the_fence():
    text = 'ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "PST"}<｜tool▁call▁end｜>' \
           '<｜tool▁calls▁end｜>'
    assert tool_calls.parse_deepseek(text).calls == [("get_time", '{"zone": "PST"}')]
    assert tool_calls.parse_deepseek(text).content == "ok"


def test_glm_values_follow_the_declared_parameter_types():
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>2024</arg_value>\n" \
           "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    ((name, args),) = tool_calls.parse_glm45(text, tuple(TOOLS)).calls
    assert name == "get_weather" and json.loads(args) == {"city": "2024", "days": 3}  # city is a string


def test_harmony_analysis_is_dropped_final_is_content_and_commentary_to_functions_is_a_call():
    generated = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary " \
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo", "days": 1}<|call|>'
    parsed = tool_calls.parse_harmony(generated)
    assert parsed.calls == [("get_weather", '{"city": "Oslo", "days": 1}')] and parsed.content == ""
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi there!"
    assert tool_calls.parse_harmony(final).content == "Hi there!" and not tool_calls.parse_harmony(final).calls


# ---- streaming -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fixture", "content"), [("qwen3", "Checking."), ("deepseek_v3", "Checking."),
                                                   ("glm45", ""), ("gpt_oss", "")])
def test_streamed_character_by_character_equals_the_whole_parse(fixture, content):
    family = FAMILY_OF_FIXTURE[fixture]
    text = _assistant_turn(fixture, TWO if fixture != "gpt_oss" else ONE, content)
    want = tool_calls.parse(text, family, tuple(TOOLS))
    stream = tool_calls.ToolStream(family, tuple(TOOLS))
    got_content, got_calls = "", []
    for ch in text:
        piece, calls = stream.feed(ch)
        got_content += piece
        got_calls += calls
    piece, calls = stream.finish()
    got_content += piece
    got_calls += calls
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == want.calls
    assert [c["index"] for c in got_calls] == list(range(len(want.calls)))
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    assert got_content.strip() == want.content
    assert stream.called


def test_streamed_plain_text_is_released_whole_and_holds_back_only_a_possible_marker():
    stream = tool_calls.ToolStream("hermes")
    assert stream.feed("Sunny <tool") == ("Sunny ", [])  # "<tool" might start a call: held back
    assert stream.feed("s are handy") == ("<tools are handy", [])
    assert stream.finish() == ("", []) and not stream.called


# ---- forced calls on the embedded model ---------------------------------------------------------------------------

def _serve(job, tokenizer, model, cfg, tpl=None):
    """The router's path without Ray: plan (render, grammar), the batcher, the response as the front builds it."""
    llg = grammar_tokenizer(tokenizer.to_str(), cfg.vocab_size, cfg.eos_token_id)
    tpl = tpl or load_chat_template(EMBEDDED_MODEL_DIR)
    plan = openai_requests.plan(job, cfg, lambda t: tokenizer.encode(t).ids,
                                lambda t: tokenizer.encode(t, add_special_tokens=False).ids, tpl, lambda: llg)

    async def main():
        batcher = ContinuousBatcher(model, tokenizer.decode)
        got = openai_responses.Accumulated()
        got.add({"tools": {"index": 0, "family": plan.tool_family}})
        chunks = openai_responses.ChunkWriter(job, "id", 0)
        streamed = chunks.event({"tools": {"index": 0, "family": plan.tool_family}})
        async for event in batcher.stream(plan.requests[0]):
            as_dict = openai_requests.event_dict(event, lambda t: tokenizer.decode([t]), 0, len(plan.prompt_ids[0]))
            got.add(as_dict)
            streamed += chunks.event(as_dict)
        return openai_responses.response(job, "id", 0, got), streamed

    return asyncio.run(asyncio.wait_for(main(), 120))


def _config():
    return load_model_config(EMBEDDED_MODEL_DIR)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_choice_makes_the_embedded_model_call_a_tool(choice):
    tokenizer, model, cfg = load_tokenizer(EMBEDDED_MODEL_DIR), load_reference_model(EMBEDDED_MODEL_DIR), _config()
    job = parse_chat(chat(tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=60), MODEL)
    body, chunks = _serve(job, tokenizer, model, cfg)
    (choice_body,) = body["choices"]
    assert choice_body["finish_reason"] == "tool_calls", choice_body
    (call,) = choice_body["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if isinstance(choice, dict):
        assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), spec[call["function"]["name"]])
    # The stream carries the same call as a tool_calls delta and ends with finish_reason tool_calls.
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(tc["function"]["name"], tc["function"]["arguments"]) for tc in streamed] == \
        [(call["function"]["name"], call["function"]["arguments"])]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tools_reach_the_template():
    tokenizer, cfg = load_tokenizer(EMBEDDED_MODEL_DIR), _config()
    encode = lambda t: tokenizer.encode(t).ids  # noqa: E731
    job = parse_chat(chat(tools=TOOLS), MODEL)
    seen = []

    def capture(text):
        seen.append(text)
        return encode(text)[:8]

    plan = openai_requests.plan(job, cfg, encode, capture, template("qwen3"))
    assert plan.tool_family == "hermes" and '"name": "get_weather"' in seen[0] and "<tools>" in seen[0]


# The markers each family's tokenizer has as special tokens (gpt-oss's certainly; DeepSeek's and GLM's as a
# tokenizer may have them): added to the embedded tokenizer to check the forced grammars token by token.
MARKERS = {
    "harmony": ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|end|>"],
    "deepseek": ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁calls▁end｜>"],
    "glm45": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
}
HARMONY_CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", ' \
               '"days": 2}<|call|>'


def _family_tokenizer(family):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(load_tokenizer(EMBEDDED_MODEL_DIR).to_str())
    tok.add_special_tokens(MARKERS[family])
    specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return tok, specials, grammar_tokenizer(tok.to_str(), tok.get_vocab_size(), 1)


@pytest.mark.parametrize(("fixture", "choice"), [
    ("gpt_oss", "required"), ("deepseek_v3", "required"), ("glm45", "required"),
    ("gpt_oss", {"type": "function", "function": {"name": "get_weather"}}),
    ("deepseek_v3", {"type": "function", "function": {"name": "get_weather"}}),
])
def test_forced_grammars_of_special_token_families_accept_their_own_calls_token_by_token(fixture, choice):
    from llguidance import LLMatcher

    family = FAMILY_OF_FIXTURE[fixture]
    tok, specials, llg = _family_tokenizer(family)
    job = parse_chat(chat(tools=TOOLS, tool_choice=choice), MODEL)
    cfg = _config()
    prompt_ids = [5, 6, 7]  # the rendered prompt's ids do not matter here (the model's vocabulary lacks the markers)
    plan = openai_requests.plan(job, cfg, lambda t: prompt_ids, lambda t: prompt_ids, template(fixture),
                                lambda: llg, lambda: specials)
    grammar = plan.requests[0].grammar.grammar
    text = HARMONY_CALL if family == "harmony" else _assistant_turn(fixture, ONE)
    if family == "glm45":  # the template's turn opens with an empty think block; a forced call starts at the call
        text = text[text.index("<tool_call>"):text.index("</tool_call>") + len("</tool_call>")]
    ids = tok.encode(text, add_special_tokens=False).ids
    assert any(i in specials.values() for i in ids)  # the markers are special tokens here
    matcher = LLMatcher(llg, grammar)
    first = allowed_ids(matcher)
    assert first == [ids[0]] and ids[0] in specials.values()  # the marker's token, never its text spelled out
    assert matcher.consume_tokens(ids), matcher.get_error()
    assert matcher.is_accepting()
    assert tool_calls.parse(tok.decode(ids, skip_special_tokens=False), family, tuple(TOOLS)).calls == \
        [("get_weather", json.dumps({"city": "Paris", "days": 2}))]
    wrong = tok.encode(text.replace("get_weather", "get_wether"), add_special_tokens=False).ids
    assert not LLMatcher(llg, grammar).consume_tokens(wrong)


def allowed_ids(matcher) -> list[int]:
    from expertmesh.router_service.grammar_mask import allowed

    return allowed(matcher.compute_bitmask(), 4096).nonzero().flatten().tolist()


def test_special_families_see_special_tokens_in_their_text_and_never_eos():
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)  # its <|pad|> (id 2) is a special token the batcher's text skips
    words = tokenizer.encode("Hello there").ids
    ids = [words[0], 2, *words[1:], 1]  # ... <|pad|> ... then eos (id 1)
    special = tool_calls.SpecialText(lambda t: tokenizer.decode(t, skip_special_tokens=False), eos_token_id=1)
    out = "".join(special.rewrite({"token": {"index": 0, "ids": [t], "text": tokenizer.decode([t])}})["token"]["text"]
                  for t in ids)
    assert "<|pad|>" in out and "<|eos|>" not in out
    assert out.replace("<|pad|>", "") == tokenizer.decode(ids)
    assert special.rewrite({"done": {"index": 0}}) == {"done": {"index": 0}}
    # A job re-sent after failover continues after the text its client has.
    resumed = tool_calls.SpecialText(lambda t: tokenizer.decode(t, skip_special_tokens=False), 1, ((words[0], 2),))
    rest = resumed.rewrite({"token": {"index": 0, "ids": words[1:], "text": ""}})["token"]["text"]
    assert out.startswith(tokenizer.decode([words[0], 2], skip_special_tokens=False)) and out.endswith(rest)


def test_the_tools_event_comes_only_with_the_first_event_so_a_refused_request_fails_first():
    from expertmesh.router_service import openai_generation
    from expertmesh.router_service.batching import DoneEvent, QueueFullError

    tokenizer, cfg = load_tokenizer(EMBEDDED_MODEL_DIR), _config()
    job = parse_chat(chat(tools=TOOLS), MODEL)
    plan = openai_requests.plan(job, cfg, lambda t: tokenizer.encode(t).ids,
                                lambda t: tokenizer.encode(t, add_special_tokens=False).ids,
                                load_chat_template(EMBEDDED_MODEL_DIR))

    async def refused(request):
        raise QueueFullError("full")
        yield  # an async generator, as the batcher's stream

    async def one_token(request):
        yield DoneEvent("eos", len(request.prompt_ids), 1, {})

    async def first_of(stream):
        events = openai_generation.job_events(job, plan, stream, score=None, decode=tokenizer.decode,
                                              token_text=lambda t: "")
        try:
            return [await anext(events), await anext(events)]
        finally:
            await events.aclose()

    with pytest.raises(QueueFullError):
        asyncio.run(first_of(refused))
    tools_event, done = asyncio.run(first_of(one_token))
    assert tools_event == {"tools": {"index": 0, "family": "hermes"}} and "done" in done
