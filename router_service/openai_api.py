"""The OpenAI HTTP API's requests and responses <-> expertmesh's own types. Pure (no Ray, no HTTP server): the HTTP
front parses and validates request bodies here, the router deployment turns jobs into GenerationRequests, and the
front assembles responses, stream chunks and errors here; unit tests cover it directly.

Supported: /v1/completions and /v1/chat/completions with max_tokens / max_completion_tokens, temperature, top_p,
seed, stop (strings), n = 1, logprobs / top_logprobs, stream + stream_options.include_usage. Fields that would
change the output and that expertmesh does not implement (penalties, logit_bias, best_of, echo, suffix, tools,
response_format other than text, n > 1) are refused with a 400 naming them, never silently ignored.
expertmesh's routing summary rides in an `expertmesh` field that standard clients ignore.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

# gRPC status code names (router_service/proto_mapping.py ApiError.code) -> HTTP status.
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
               "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503,
               "DEADLINE_EXCEEDED": 504, "INTERNAL": 500}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
              503: "service_unavailable_error", 504: "timeout_error", 500: "server_error"}
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limits: completions logprobs ≤ 5, chat top_logprobs ≤ 20
MAX_CHAT_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what fits the context
_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]]*$")


class OpenAIError(Exception):
    """An error as OpenAI returns it: HTTP status and {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        kind = ERROR_TYPE.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.code}}

    def __reduce__(self):
        return (OpenAIError, (self.status, self.message, self.param, self.code))


def invalid(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


def from_status(code: str, message: str) -> OpenAIError:
    """An ApiError (gRPC code name, "field: message") as an OpenAI error; the field becomes `param`."""
    status = HTTP_STATUS.get(code, 500)
    head = message.split(": ", 1)[0]
    param = head if ": " in message and _FIELD.match(head) else None
    error_code = {404: "model_not_found" if param == "model" else "not_found", 429: "rate_limit_exceeded",
                  503: "service_unavailable", 401: "invalid_api_key"}.get(status)
    if status == 400:
        error_code = "invalid_value"
    return OpenAIError(status, message, param=param, code=error_code)


@dataclass(frozen=True)
class OpenAIJob:
    """One validated OpenAI generation request, as plain data the router deployment can take through a handle."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: str | None = None  # completions: text ...
    prompt_ids: tuple[int, ...] | None = None  # ... or token ids
    messages: tuple[dict, ...] | None = None  # chat
    max_tokens: int | None = None  # None: as many as fit the model's context
    max_tokens_param: str = "max_tokens"  # the field it came from, for errors
    temperature: float = 1.0  # OpenAI's default; 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None  # None: no logprobs
    stream: bool = False
    include_usage: bool = False

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"


# ---- request bodies ------------------------------------------------------------------------------------------

def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(None, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid(None, "the body must be a JSON object")
    return body


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


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"must be true or false, got {json.dumps(value)[:64]}")
    return value


def _common(body: dict, served_model: str) -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "required: the model name (GET /v1/models lists it)")
    if model != served_model:
        shown = model if len(model) <= 64 else model[:64] + "…"
        raise OpenAIError(404, f"model: the model {shown!r} does not exist; this server serves {served_model!r}",
                          param="model", code="model_not_found")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise invalid("n", f"only n = 1 is supported, got {json.dumps(n)[:64]}; send separate requests (with "
                           "different seeds) for more choices")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise invalid(name, "is not supported; leave it out or 0")
    if body.get("logit_bias"):
        raise invalid("logit_bias", "is not supported")
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
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "is only allowed with stream: true")
        if not isinstance(options, dict):
            raise invalid("stream_options", "must be an object")
        include_usage = _bool(options, "include_usage")
    return {
        "model": model, "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        "seed": _optional_int(body, "seed", 0, 2**63 - 1), "stop": stops, "stream": stream,
        "include_usage": include_usage,
    }


def parse_completion(body: dict, served_model: str) -> OpenAIJob:
    """POST /v1/completions: a validated job, or OpenAIError (400 naming `param`, 404 for another model)."""
    common = _common(body, served_model)
    if body.get("echo"):
        raise invalid("echo", "is not supported")
    if body.get("suffix"):
        raise invalid("suffix", "is not supported")
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of", "only best_of = 1 is supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    text, ids = None, None
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "must not be empty")
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = tuple(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise invalid("prompt", f"a batch of {len(prompt)} prompts is not supported; send one per request")
    else:
        raise invalid("prompt", "required: a string, or a list of token ids")
    max_tokens = _optional_int(body, "max_tokens", 1)
    logprobs = _optional_int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return OpenAIJob(kind="completion", prompt=text, prompt_ids=ids,
                     max_tokens=DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
                     top_logprobs=logprobs, **common)


def parse_chat(body: dict, served_model: str) -> OpenAIJob:
    """POST /v1/chat/completions: a validated job, or OpenAIError."""
    common = _common(body, served_model)
    for name in ("tools", "functions"):
        if body.get(name):
            raise invalid(name, "tool calling is not supported")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict)
                                        or response_format.get("type") != "text"):
        raise invalid("response_format", "only {\"type\": \"text\"} is supported")
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
    return OpenAIJob(kind="chat", messages=clean, max_tokens=max_tokens, max_tokens_param=param,
                     top_logprobs=(top or 0) if want_logprobs else None, **common)


def _message(i: int, message) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise invalid(where, "must be an object with role and content")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "tool", "developer"):
        raise invalid(f"{where}.role", f"must be system, user, assistant, tool or developer, got "
                                       f"{json.dumps(role)[:64]}")
    content = message.get("content")
    if content is None and role == "assistant":
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
    return {"role": role, "content": content}


# ---- responses -----------------------------------------------------------------------------------------------

def finish_reason(batcher_reason: str) -> str:
    """The batcher's eos / stop / length -> OpenAI's stop / length."""
    return "length" if batcher_reason == "length" else "stop"


def usage(done: dict) -> dict:
    return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}


def routing_extension(done: dict) -> dict:
    """expertmesh's own summary of the request's routing: slots per expert per layer, the experts each layer hit,
    and the slots rerouted (capacity cap), degraded (no live replica), dropped (capacity cap, every expert full)
    and shed (overload shedding: moved off an overloaded expert)."""
    per_layer = {str(layer): counts for layer, counts in done["tokens_per_expert"].items()}
    return {"routing": {
        "tokens_per_expert": per_layer,
        "experts_hit": {layer: [e for e, c in enumerate(counts) if c] for layer, counts in per_layer.items()},
        "rerouted_tokens": done["rerouted"], "degraded_tokens": done["degraded"],
        "dropped_tokens": done["dropped"], "shed_tokens": done.get("shed", 0),
    }}


def completion_logprobs(entries: list[dict], start_offset: int = 0) -> dict:
    """Legacy completions logprobs. entries: [{"token": str, "logprob": float, "top": [[str, float], ...]}]."""
    offsets, at = [], start_offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t: lp for t, lp in e["top"]} for e in entries], "text_offset": offsets}


def chat_logprobs(entries: list[dict]) -> dict:
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [one(e["token"], e["logprob"]) | {"top_logprobs": [one(t, lp) for t, lp in e["top"]]}
                        for e in entries]}


@dataclass
class Accumulated:
    """A whole (non-streamed) response's parts, gathered from the deployment's token and done events."""

    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    done: dict | None = None

    def add(self, event: dict) -> None:
        if "token" in event:
            self.text += event["token"]["text"]
            self.logprobs.extend(event["token"].get("logprobs") or [])
        else:
            self.done = event["done"]


def response(job: OpenAIJob, request_id: str, created: int, got: Accumulated) -> dict:
    """The whole response body of a non-streamed request."""
    done = got.done
    reason = finish_reason(done["finish_reason"])
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": got.text}, "finish_reason": reason,
                  "logprobs": chat_logprobs(got.logprobs) if job.top_logprobs is not None else None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": got.text, "finish_reason": reason,
                  "logprobs": completion_logprobs(got.logprobs) if job.top_logprobs is not None else None}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": job.model, "choices": [choice],
            "usage": usage(done), "expertmesh": routing_extension(done)}


class ChunkWriter:
    """The chunks of a streamed response, one per deployment event (SSE framing is `sse()`)."""

    def __init__(self, job: OpenAIJob, request_id: str, created: int):
        self.job, self.request_id, self.created = job, request_id, created
        self.text_offset = 0
        self.object = "chat.completion.chunk" if job.kind == "chat" else "text_completion"

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": self.object, "created": self.created, "model": self.job.model,
                "choices": choices, **extra}

    def first(self) -> list[dict]:
        """Chat streams open with the assistant role, as OpenAI's do."""
        if self.job.kind != "chat":
            return []
        return [self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])]

    def event(self, event: dict) -> list[dict]:
        if "token" in event:
            token = event["token"]
            if not token["text"] and not token.get("logprobs"):
                return []  # text held back (half a character, a possible stop string): nothing to send yet
            return [self._chunk([self._choice(token["text"], token.get("logprobs") or [], None)])]
        done = event["done"]
        chunks = [self._chunk([self._choice("", [], finish_reason(done["finish_reason"]))],
                              expertmesh=routing_extension(done))]
        if self.job.include_usage:
            chunks.append(self._chunk([], usage=usage(done)))
        return chunks

    def _choice(self, text: str, entries: list[dict], reason: str | None) -> dict:
        want = self.job.top_logprobs is not None
        if self.job.kind == "chat":
            delta = {"content": text} if text or reason is None else {}
            return {"index": 0, "delta": delta, "logprobs": chat_logprobs(entries) if want and entries else None,
                    "finish_reason": reason}
        logprobs = completion_logprobs(entries, self.text_offset) if want and entries else None
        self.text_offset += len(text)
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}


def sse(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "expertmesh"}]}
