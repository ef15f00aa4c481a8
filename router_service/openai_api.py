"""The OpenAI HTTP API's requests and responses <-> expertmesh's own types. Pure (no Ray, no HTTP server): the HTTP
front parses and validates request bodies here, the router deployment turns jobs into GenerationRequests, and the
front assembles responses, stream chunks and errors here; unit tests cover it directly.

Supported (docs/serving/openai-http.md lists every field): /v1/completions and /v1/chat/completions with
max_tokens / max_completion_tokens, temperature, top_p, top_k, seed, stop (strings), stop_token_ids, ignore_eos,
min_tokens, n, best_of (completions), presence / frequency / repetition penalties, logit_bias, logprobs /
top_logprobs, echo with prompt logprobs (completions; max_tokens = 0 allowed with it), a batch of prompts
(completions), stream + stream_options (include_usage, continuous_usage_stats), structured output (response_format
json_object / json_schema and vLLM's structured_outputs / guided_* regex, choice, grammar: structured_output.py).
tools / tool_choice in chat (tool_calls.py). Fields that would change the output and that expertmesh does not
implement (suffix, the deprecated functions) are refused with a 400 naming them, never silently ignored.
expertmesh's routing summary rides in an `expertmesh` field that standard clients ignore.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from . import structured_output, tool_calls
from .openai_errors import ERROR_TYPE, HTTP_STATUS, OpenAIError, from_status, invalid  # noqa: F401 - re-exported
from .structured_output import Constraint
from .tool_calls import ToolRequest

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 128  # OpenAI's limit on n
MAX_BEST_OF = 20  # OpenAI's limit on best_of
MAX_CHOICES = 128  # our bound on the sequences one request may start (prompts × best_of)
MAX_REPETITION_PENALTY = 2.0  # as router_service/sampling.py (kept here so the HTTP front imports no torch)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limits: completions logprobs ≤ 5, chat top_logprobs ≤ 20
MAX_CHAT_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what fits the context


@dataclass(frozen=True)
class OpenAIJob:
    """One validated OpenAI generation request, as plain data the router deployment can take through a handle."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: tuple[str | tuple[int, ...], ...] = ()  # completions: each a text or token ids (a batch: several)
    messages: tuple[dict, ...] | None = None  # chat
    max_tokens: int | None = None  # None: as many as fit the model's context
    max_tokens_param: str = "max_tokens"  # the field it came from, for errors
    temperature: float = 1.0  # OpenAI's default; 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (vLLM's extension)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1  # choices returned per prompt
    best_of: int | None = None  # candidates generated per prompt, the n with the highest cumulative logprob kept
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion
    top_logprobs: int | None = None  # None: no logprobs
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    constraint: Constraint | None = None  # structured output: the grammar every choice's tokens must follow
    tools: ToolRequest | None = None  # chat: the functions the model may call (None: none, or tool_choice none)
    # Failover only (router_service/openai_continuation.py): set by the HTTP front when it re-sends the job to a live
    # router replica, never from a client's body. Per choice index, the token ids the client already has; the
    # choices whose echo, and whose final event, it already has.
    resumed: tuple[tuple[int, ...], ...] = ()
    echoed: tuple[int, ...] = ()
    finished: tuple[int, ...] = ()

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    @property
    def candidates(self) -> int:
        """Sequences generated per prompt: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def num_prompts(self) -> int:
        return 1 if self.kind == "chat" else len(self.prompts)

    @property
    def num_choices(self) -> int:
        """Choices in the response: n per prompt, prompt-major (choice index = prompt × n + j)."""
        return self.num_prompts * self.n


# ---- request bodies ------------------------------------------------------------------------------------------

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise invalid(name, f"must be a number, got {json.dumps(value)[:64]}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(name, f"must be in {bracket}{low:g}, {high:g}], got {value:g}")
    return float(value)


def _optional_int(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise invalid(name, f"must be an integer, got {json.dumps(value)[:64]}")
    if value < low or (high is not None and value > high):
        upper = f", {high}]" if high is not None else ", ∞)"
        raise invalid(name, f"must be in [{low}{upper}, got {value}")
    return value


def _bool(body: dict, name: str, where: str = "") -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(where + name, f"must be true or false, got {json.dumps(value)[:64]}")
    return value


def _common(body: dict, served_model: str) -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "required: the model name (GET /v1/models lists it)")
    if model != served_model:
        shown = model if len(model) <= 64 else model[:64] + "…"
        raise OpenAIError(404, f"model: the model {shown!r} does not exist; this server serves {served_model!r}",
                          param="model", code="model_not_found")
    n = _optional_int(body, "n", 1, MAX_N)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise invalid("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise invalid("stop", f"at most {MAX_STOP} stop sequences, got {len(stops)}")
    if any(s == "" for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = continuous_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "is only allowed with stream: true")
        if not isinstance(options, dict):
            raise invalid("stream_options", "must be an object")
        include_usage = _bool(options, "include_usage", "stream_options.")
        continuous_usage = _bool(options, "continuous_usage_stats", "stream_options.")
    return {
        "model": model, "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        "top_k": _top_k(body),
        "seed": _optional_int(body, "seed", 0, 2**63 - 1), "stop": stops, "stream": stream,
        "include_usage": include_usage, "continuous_usage": continuous_usage, "n": 1 if n is None else n,
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, low_open=True),
        "logit_bias": _logit_bias(body), "stop_token_ids": _token_ids(body, "stop_token_ids"),
        "ignore_eos": _bool(body, "ignore_eos"), "min_tokens": _optional_int(body, "min_tokens", 0) or 0,
        "constraint": structured_output.parse(body),
    }


def _top_k(body: dict) -> int:
    """vLLM's top_k extension: -1 or 0 = off, else ≥ 1."""
    value = _optional_int(body, "top_k", -1)
    return 0 if value is None or value == -1 else value


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id as a string": bias in [-100, 100]} -> ((id, bias), ...) sorted by id; the vocabulary
    bound is checked against the model (openai_requests)."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias", "must be an object mapping token ids (as strings) to biases in [-100, 100]")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise invalid("logit_bias", f"keys must be token ids as strings, got {json.dumps(key)[:64]}")
        if not (isinstance(bias, int | float) and not isinstance(bias, bool) and math.isfinite(bias)
                and -100 <= bias <= 100):
            raise invalid("logit_bias", f"the bias of token {key} must be a number in [-100, 100], got "
                                        f"{json.dumps(bias)[:64]}")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _token_ids(body: dict, name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise invalid(name, "must be a list of token ids (integers ≥ 0)")
    return tuple(value)


def parse_completion(body: dict, served_model: str) -> OpenAIJob:
    """POST /v1/completions: a validated job, or OpenAIError (400 naming `param`, 404 for another model)."""
    common = _common(body, served_model)
    if body.get("suffix"):
        raise invalid("suffix", "is not supported")
    echo = _bool(body, "echo")
    prompts = _prompts(body.get("prompt"))
    max_tokens = _optional_int(body, "max_tokens", 0 if echo else 1)
    if max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs = _optional_int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    best_of = _optional_int(body, "best_of", 1, MAX_BEST_OF)
    if best_of is not None and best_of < common["n"]:
        raise invalid("best_of", f"must be ≥ n ({common['n']}), got {best_of}")
    if best_of is not None and best_of > common["n"] and common["stream"]:
        raise invalid("best_of", "best_of > n cannot be streamed (the best are known only at the end)")
    if len(prompts) * (best_of or common["n"]) > MAX_CHOICES:
        raise invalid("n", f"{len(prompts)} prompts × {best_of or common['n']} sequences each exceed the "
                           f"server's limit of {MAX_CHOICES} per request")
    if common["min_tokens"] > max_tokens and max_tokens > 0:
        raise invalid("min_tokens", f"must be ≤ max_tokens ({max_tokens}), got {common['min_tokens']}")
    return OpenAIJob(kind="completion", prompts=prompts, max_tokens=max_tokens, top_logprobs=logprobs, echo=echo,
                     best_of=best_of if best_of != common["n"] else None, **common)


def _prompts(prompt) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's prompt: a string, token ids, or a batch (a list of strings or of token-id lists)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt", "required: a string, a list of token ids, or a batch of them")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise invalid(where, "must not be empty")
            out.append(item)
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            out.append(tuple(item))
        else:
            raise invalid(where, "must be a non-empty string or a non-empty list of token ids")
    return tuple(out)


def parse_chat(body: dict, served_model: str) -> OpenAIJob:
    """POST /v1/chat/completions: a validated job, or OpenAIError."""
    common = _common(body, served_model)
    tools = tool_calls.parse_tools(body)
    if tools is not None and tools.forced:  # required / a named function: the output is forced to be a call
        if common["constraint"] is not None:
            raise invalid("tool_choice", f"a required or named tool_choice cannot be combined with "
                                         f"{common['constraint'].param}")
        common["constraint"] = tool_calls.forced_grammar(tools)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "required: a non-empty list of {role, content}")
    clean = tuple(_message(i, m) for i, m in enumerate(messages))
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        max_tokens, param = _optional_int(body, "max_completion_tokens", 1), "max_completion_tokens"
    else:
        max_tokens, param = _optional_int(body, "max_tokens", 1), "max_tokens"
    want_logprobs = _bool(body, "logprobs")
    top = _optional_int(body, "top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not want_logprobs:
        raise invalid("top_logprobs", "needs logprobs: true")
    if max_tokens is not None and common["min_tokens"] > max_tokens:
        raise invalid("min_tokens", f"must be ≤ {param} ({max_tokens}), got {common['min_tokens']}")
    return OpenAIJob(kind="chat", messages=clean, max_tokens=max_tokens, max_tokens_param=param,
                     top_logprobs=(top or 0) if want_logprobs else None, tools=tools, **common)


def _message(i: int, message) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise invalid(where, "must be an object with role and content")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "tool", "developer"):
        raise invalid(f"{where}.role", f"must be system, user, assistant, tool or developer, got "
                                       f"{json.dumps(role)[:64]}")
    content = message.get("content")
    if content is None and role in ("assistant", "tool"):
        content = ""
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) "
                                                       "are supported")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise invalid(f"{where}.content", "must be a string or a list of text parts")
    out = {"role": role, "content": content}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _assistant_calls(where, message["tool_calls"])
    if role == "tool":
        call = message.get("tool_call_id")
        if call is not None and not isinstance(call, str):
            raise invalid(f"{where}.tool_call_id", "must be a string")
        if call is not None:
            out["tool_call_id"] = call
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _assistant_calls(where: str, calls) -> list[dict]:
    """An assistant message's earlier tool_calls, as OpenAI sends them (arguments a JSON string)."""
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls", "must be a list of {id, type: function, function: {name, arguments}}")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", "{}"), str | dict):
            raise invalid(f"{where}.tool_calls[{k}]", "must be {id, type: function, function: {name, arguments}}")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    return out


# ---- framing (responses and chunks: router_service/openai_responses.py) ---------------------------------------

def sse(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "expertmesh"}]}
