"""The OpenAI request/response mapping (router_service/openai_api.py, openai_requests.py): every refused field is
a 400 naming it in `param`, codes map to HTTP as documented, and responses/chunks have OpenAI's shape."""

from __future__ import annotations

import json

import pytest
import torch

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.router_service import openai_api, openai_requests, openai_responses
from expertmesh.router_service.batching import DoneEvent, TokenEvent, token_logprobs
from expertmesh.router_service.chat_template import load_chat_template
from expertmesh.router_service.errors import RequestError
from expertmesh.router_service.openai_api import OpenAIError, parse_chat, parse_completion

MODEL = "m"


def refused(parse, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(body, MODEL)
    return info.value


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x"}, "model"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": [1, "a"]}, "prompt[0]"),
    ({"model": MODEL, "prompt": ["a", ""]}, "prompt[1]"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -0.1}, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": 2.5}, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.1}, "top_p"),
    ({"model": MODEL, "prompt": "x", "seed": -1}, "seed"),
    ({"model": MODEL, "prompt": "x", "stop": 3}, "stop"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, "stop"),
    ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "x", "n": 129}, "n"),
    ({"model": MODEL, "prompt": ["x"] * 20, "n": 7}, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": MODEL, "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": MODEL, "prompt": "x", "best_of": 2, "n": 3}, "best_of"),
    ({"model": MODEL, "prompt": "x", "best_of": 21}, "best_of"),
    ({"model": MODEL, "prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": [5]}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [1, -2]}, "stop_token_ids"),
    ({"model": MODEL, "prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"model": MODEL, "prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"model": MODEL, "prompt": "x", "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"model": MODEL, "prompt": "x", "top_k": -2}, "top_k"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": 2}},
     "stream_options.continuous_usage_stats"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
])
def test_completion_refusals_name_the_param(body, param):
    error = refused(parse_completion, body)
    assert (error.status, error.param) == (400 if param != "model" else 400, param)
    assert error.body()["error"]["type"] == "invalid_request_error"
    assert error.body()["error"]["message"].startswith(f"{param}: ")


@pytest.mark.parametrize(("body", "param"), [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": ["hi"]}, "messages[0]"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
     "max_completion_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "bogus"}}}},
     "response_format"),
])
def test_chat_refusals_name_the_param(body, param):
    error = refused(parse_chat, body)
    assert (error.status, error.param) == (400, param)


def test_unknown_model_is_404():
    error = refused(parse_completion, {"model": "gpt-4o", "prompt": "x"})
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")


def test_accepted_fields():
    job = parse_completion({"model": MODEL, "prompt": ["hello"], "max_tokens": 7, "temperature": 0, "top_p": 0.5,
                            "seed": 3, "stop": "\n", "n": 1, "logprobs": 2, "stream": True,
                            "stream_options": {"include_usage": True}, "user": "ignored"}, MODEL)
    assert (job.prompts, job.max_tokens, job.temperature, job.top_p, job.seed, job.stop, job.top_logprobs,
            job.stream, job.include_usage) == (("hello",), 7, 0.0, 0.5, 3, ("\n",), 2, True, True)
    assert parse_completion({"model": MODEL, "prompt": [[1, 2]]}, MODEL).prompts == ((1, 2),)
    assert parse_completion({"model": MODEL, "prompt": [1, 2]}, MODEL).prompts == ((1, 2),)
    batch = parse_completion({"model": MODEL, "prompt": ["a", [3]], "n": 2, "best_of": 3}, MODEL)
    assert (batch.prompts, batch.n, batch.best_of, batch.candidates, batch.num_choices) == (("a", (3,)), 2, 3, 3, 4)
    assert parse_completion({"model": MODEL, "prompt": "x", "n": 2, "best_of": 2}, MODEL).best_of is None
    rules = parse_completion({"model": MODEL, "prompt": "x", "presence_penalty": -1, "frequency_penalty": 0.5,
                              "repetition_penalty": 1.2, "logit_bias": {"7": -100, "3": 5.5},
                              "stop_token_ids": [4], "ignore_eos": True, "min_tokens": 2, "top_k": -1,
                              "echo": True, "max_tokens": 0, "stream": True,
                              "stream_options": {"continuous_usage_stats": True}}, MODEL)
    assert (rules.presence_penalty, rules.frequency_penalty, rules.repetition_penalty, rules.logit_bias,
            rules.stop_token_ids, rules.ignore_eos, rules.min_tokens, rules.top_k, rules.echo, rules.max_tokens,
            rules.continuous_usage) == (-1.0, 0.5, 1.2, ((3, 5.5), (7, -100.0)), (4,), True, 2, 0, True, 0, True)
    assert parse_completion({"model": MODEL, "prompt": "x"}, MODEL).max_tokens == 16  # OpenAI's default
    chat = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b"}]}],
                       "max_tokens": 3, "max_completion_tokens": 5, "logprobs": True}, MODEL)
    assert chat.messages == ({"role": "user", "content": "ab"},)
    assert (chat.max_tokens, chat.max_tokens_param, chat.top_logprobs) == (5, "max_completion_tokens", 0)
    assert parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, MODEL).max_tokens is None


@pytest.mark.parametrize(("code", "message", "status", "param"), [
    ("INVALID_ARGUMENT", "max_tokens: prompt (5 tokens) + max_tokens exceed", 400, "max_tokens"),
    ("INVALID_ARGUMENT", "messages[0].content: bad", 400, "messages[0].content"),
    ("RESOURCE_EXHAUSTED", "server busy: 3 requests already waiting (max_waiting); retry later", 429, None),
    ("UNAVAILABLE", "an expert actor is unavailable: ActorDiedError", 503, None),
    ("UNAUTHENTICATED", "missing or wrong bearer token", 401, None),
    ("NOT_FOUND", "model: unknown model 'x'", 404, "model"),
    ("INTERNAL", "internal error (KeyError); see the router's log", 500, None),
])
def test_status_codes(code, message, status, param):
    error = openai_api.from_status(code, message)
    assert (error.status, error.param) == (status, param)
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


# ---- jobs -> generation requests ------------------------------------------------------------------------------

class _Cfg:
    vocab_size = 100
    max_position_embeddings = 32
    eos_token_id = 1


def request_of(body, kind="completion", template=None):
    job = (parse_chat if kind == "chat" else parse_completion)(body, MODEL)
    encode = lambda text: [3 + ord(c) % 50 for c in text]  # noqa: E731 (a toy tokenizer)
    return openai_requests.plan(job, _Cfg(), encode, encode, template).requests[0]


def test_generation_request():
    req = request_of({"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0, "stop": ["x"],
                      "logprobs": 3})
    assert (len(req.prompt_ids), req.max_tokens, req.stop_strings, req.top_logprobs, req.eos_token_id) == \
        (3, 4, ("x",), 3, 1)
    assert req.sampling.greedy
    chat = request_of({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "chat",
                      load_chat_template(EMBEDDED_MODEL_DIR))
    assert chat.max_tokens == 32 - len(chat.prompt_ids)  # chat without a limit: what the context leaves


@pytest.mark.parametrize(("body", "kind", "field"), [
    ({"model": MODEL, "prompt": "a" * 40, "max_tokens": 1}, "completion", "prompt"),
    ({"model": MODEL, "prompt": "abc", "max_tokens": 30}, "completion", "max_tokens"),
    ({"model": MODEL, "prompt": [5, 500]}, "completion", "prompt"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 99}, "chat",
     "max_completion_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "chat", "messages"),  # no template
])
def test_generation_request_refusals(body, kind, field):
    template = load_chat_template(EMBEDDED_MODEL_DIR) if "max_completion_tokens" in body else None
    with pytest.raises(RequestError) as info:
        request_of(body, kind, template)
    assert info.value.field == field


# ---- responses ------------------------------------------------------------------------------------------------

DONE = DoneEvent(finish_reason="eos", prompt_tokens=3, completion_tokens=2, tokens_per_expert={0: [2, 0, 3]},
                 rerouted=1, degraded=2, dropped=0)


def events():
    text = {5: "Hel", 6: "lo"}.get
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    return [openai_requests.event_dict(TokenEvent([5], "Hel", [token_logprobs(logits, 5, 2)]), text),
            openai_requests.event_dict(TokenEvent([6], "lo", [token_logprobs(logits, 6, 2)]), text),
            openai_requests.event_dict(DONE, text)]


def test_token_logprobs_are_log_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    chosen, top = token_logprobs(logits, 0, 2)
    expected = torch.log_softmax(logits, -1)
    assert chosen == pytest.approx(float(expected[0]))
    assert [t for t, _ in top] == [2, 1] and top[0][1] == pytest.approx(float(expected[2]))


def test_whole_responses():
    job = parse_completion({"model": MODEL, "prompt": "x", "logprobs": 2}, MODEL)
    got = openai_responses.Accumulated()
    for e in events():
        got.add(e)
    body = openai_responses.response(job, "cmpl-1", 7, got)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hel", "lo"] and lp["text_offset"] == [0, 3] and len(lp["top_logprobs"][0]) == 2
    routing = body["expertmesh"]["routing"]
    assert routing["experts_hit"] == {"0": [0, 2]} and routing["degraded_tokens"] == 2
    chat = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                       "top_logprobs": 1}, MODEL)
    body = openai_responses.response(chat, "chatcmpl-1", 7, got)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "Hel" and content[0]["bytes"] == list(b"Hel")
    assert len(content[0]["top_logprobs"]) == 2  # top_logprobs from the event; the job asked the batcher for 1


def test_stream_chunks():
    job = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
                      "stream_options": {"include_usage": True}}, MODEL)
    writer = openai_responses.ChunkWriter(job, "chatcmpl-1", 7)
    chunks = writer.first() + [c for e in events() for c in writer.event(e)]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and "expertmesh" in chunks[-2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert openai_api.sse({"a": 1}) == b'data: {"a":1}\n\n' and openai_api.SSE_DONE == b"data: [DONE]\n\n"
    assert json.loads(openai_api.sse(chunks[1])[6:]) == chunks[1]
