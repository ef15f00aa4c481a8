"""OpenAI response bodies and stream chunks from the router deployment's events. Pure (no Ray, no HTTP server).

The deployment (router_service/deployment.py OpenAIGenerate) streams plain dicts, each naming its choice `index`
(prompt-major: prompt p's j-th choice is p × n + j):

    {"echo":  {"index", "text", "logprobs": [entry, ...] | None, "prompt_tokens"}}   the prompt, when echo is on
    {"token": {"index", "ids", "text", "logprobs": [entry, ...] | None, "prompt_tokens"}}
    {"done":  {"index", "finish_reason", "prompt_tokens", "completion_tokens", "tokens_per_expert", ...}}

with entry = {"token": str, "logprob": float | None, "top": [[str, float], ...] | None} (None: the prompt's first
token, which has no context to be scored from, as in OpenAI's and vLLM's echo). A chat job with tools opens with

    {"tools": {"index": 0, "family"}}     the tool-call syntax of the model's template (router_service/tool_calls.py)

and its choices' text is parsed into `tool_calls` here (finish_reason "tool_calls" when the model called one).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from . import tool_calls
from .openai_api import OpenAIJob


def finish_reason(batcher_reason: str) -> str:
    """The batcher's eos / stop / length -> OpenAI's stop / length."""
    return "length" if batcher_reason == "length" else "stop"


def usage_of(job: OpenAIJob, dones: dict[int, dict]) -> dict:
    """Usage over every choice: each prompt's tokens once, every returned choice's completion tokens, and of the
    prompt tokens those the prefix cache served (OpenAI's prompt_tokens_details.cached_tokens; README: Prefix
    caching), counted as the prompts are: from each prompt's first choice."""
    prompt = sum(d["prompt_tokens"] for i, d in dones.items() if i % job.n == 0)
    cached = sum(d.get("cached_tokens", 0) for i, d in dones.items() if i % job.n == 0)
    completion = sum(d["completion_tokens"] for d in dones.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def routing_extension(dones: list[dict]) -> dict:
    """expertmesh's own summary of the request's routing, summed over its choices: slots per expert per layer, the
    experts each layer hit, and the slots rerouted (capacity cap), degraded (no live replica), dropped (capacity
    cap, every expert full) and shed (overload shedding: moved off an overloaded expert)."""
    per_layer: dict[str, list[int]] = {}
    for done in dones:
        for layer, counts in done["tokens_per_expert"].items():
            mine = per_layer.setdefault(str(layer), [0] * len(counts))
            per_layer[str(layer)] = [a + b for a, b in zip(mine, counts)]
    total = Counter()
    for done in dones:
        total.update({k: done.get(k, 0) for k in ("rerouted", "degraded", "dropped", "shed")})
    return {"routing": {
        "tokens_per_expert": per_layer,
        "experts_hit": {layer: [e for e, c in enumerate(counts) if c] for layer, counts in per_layer.items()},
        "rerouted_tokens": total["rerouted"], "degraded_tokens": total["degraded"],
        "dropped_tokens": total["dropped"], "shed_tokens": total["shed"],
    }}


def completion_logprobs(entries: list[dict], start_offset: int = 0) -> dict:
    """Legacy completions logprobs. entries: [{"token": str, "logprob": float | None, "top": [[str, float]] | None}]."""
    offsets, at = [], start_offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else {t: lp for t, lp in e["top"]} for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[dict]) -> dict:
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [one(e["token"], e["logprob"]) | {"top_logprobs": [one(t, lp) for t, lp in e["top"]]}
                        for e in entries]}


@dataclass
class ChoiceParts:
    """One choice's parts, gathered from its events."""

    echo_text: str = ""
    echo_logprobs: list[dict] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    done: dict | None = None


@dataclass
class Accumulated:
    """A whole (non-streamed) response's parts, per choice index, gathered from the deployment's events."""

    choices: dict[int, ChoiceParts] = field(default_factory=dict)
    tool_family: str | None = None

    def add(self, event: dict) -> None:
        kind, body = next(iter(event.items()))
        if kind == "tools":
            self.tool_family = body["family"]
            return
        parts = self.choices.setdefault(body.get("index", 0), ChoiceParts())
        if kind == "echo":
            parts.echo_text = body["text"]
            parts.echo_logprobs = body.get("logprobs") or []
        elif kind == "token":
            parts.text += body["text"]
            parts.logprobs.extend(body.get("logprobs") or [])
        else:
            parts.done = body

    @property
    def dones(self) -> dict[int, dict]:
        return {i: p.done for i, p in self.choices.items() if p.done is not None}


def response(job: OpenAIJob, request_id: str, created: int, got: Accumulated) -> dict:
    """The whole response body of a non-streamed request."""
    choices = []
    for index in sorted(got.choices):
        parts = got.choices[index]
        reason = finish_reason(parts.done["finish_reason"])
        if job.kind == "chat":
            message = {"role": "assistant", "content": parts.text}
            if job.tools is not None and got.tool_family is not None:
                parsed = tool_calls.parse(parts.text, got.tool_family, job.tools.tools)
                if parsed.calls:
                    message = {"role": "assistant", "content": parsed.content or None,
                               "tool_calls": tool_calls.tool_call_dicts(parsed.calls)}
                    reason = "tool_calls"
            choices.append({"index": index, "message": message, "finish_reason": reason,
                            "logprobs": chat_logprobs(parts.logprobs) if job.top_logprobs is not None else None})
        else:
            logprobs = None
            if job.top_logprobs is not None:
                logprobs = completion_logprobs(parts.echo_logprobs + parts.logprobs)
            choices.append({"index": index, "text": parts.echo_text + parts.text, "finish_reason": reason,
                            "logprobs": logprobs})
    dones = got.dones
    return {"id": request_id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": created, "model": job.model, "choices": choices, "usage": usage_of(job, dones),
            "expertmesh": routing_extension([dones[i] for i in sorted(dones)])}


class ChunkWriter:
    """The chunks of a streamed response, one per deployment event (SSE framing is openai_api.sse)."""

    def __init__(self, job: OpenAIJob, request_id: str, created: int):
        self.job, self.request_id, self.created = job, request_id, created
        self.text_offset: dict[int, int] = {}
        self.prompt_tokens: dict[int, int] = {}  # prompt index -> its tokens
        self.completion_tokens: dict[int, int] = {}  # choice index -> tokens so far
        self.dones: dict[int, dict] = {}
        self.object = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        self.tool_streams: dict[int, tool_calls.ToolStream] = {}  # choice index -> its text split into calls
        self.tool_family: str | None = None

    def _usage_now(self) -> dict:
        prompt, completion = sum(self.prompt_tokens.values()), sum(self.completion_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _chunk(self, choices: list[dict], **extra) -> dict:
        if self.job.continuous_usage and choices:
            extra.setdefault("usage", self._usage_now())
        return {"id": self.request_id, "object": self.object, "created": self.created, "model": self.job.model,
                "choices": choices, **extra}

    def first(self) -> list[dict]:
        """Chat streams open with the assistant role for each choice, as OpenAI's do."""
        if self.job.kind != "chat":
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.job.num_choices)]

    def event(self, event: dict) -> list[dict]:
        kind, body = next(iter(event.items()))
        index = body.get("index", 0)
        if kind == "tools":
            self.tool_family = body["family"]
            return []
        if "prompt_tokens" in body:
            self.prompt_tokens[index // self.job.n] = body["prompt_tokens"]
        if kind == "echo":
            if not body["text"] and not body.get("logprobs"):
                return []
            return [self._chunk([self._choice(index, body["text"], body.get("logprobs") or [], None)])]
        if kind == "token":
            self.completion_tokens[index] = self.completion_tokens.get(index, 0) + len(body["ids"])
            if self.tool_family is not None:
                return self._tool_chunks(index, *self._tools(index).feed(body["text"]), body.get("logprobs") or [])
            if not body["text"] and not body.get("logprobs"):
                return []  # text held back (half a character, a possible stop string): nothing to send yet
            return [self._chunk([self._choice(index, body["text"], body.get("logprobs") or [], None)])]
        self.dones[index] = body
        self.completion_tokens[index] = body["completion_tokens"]
        reason = finish_reason(body["finish_reason"])
        chunks = []
        if self.tool_family is not None:
            stream = self._tools(index)
            chunks = self._tool_chunks(index, *stream.finish(), [])
            if stream.called:
                reason = "tool_calls"
        chunks.append(self._chunk([self._choice(index, "", [], reason)], expertmesh=routing_extension([body])))
        if self.job.include_usage and len(self.dones) == self.job.num_choices:
            chunks.append(self._chunk([], usage=usage_of(self.job, self.dones)))
        return chunks

    def _tools(self, index: int) -> tool_calls.ToolStream:
        if index not in self.tool_streams:
            self.tool_streams[index] = tool_calls.ToolStream(self.tool_family, self.job.tools.tools)
        return self.tool_streams[index]

    def _tool_chunks(self, index: int, content: str, calls: list[dict], entries: list[dict]) -> list[dict]:
        """A tools choice's delta: content released so far, then each completed call (OpenAI sends them apart)."""
        chunks = []
        if content or entries:
            chunks.append(self._chunk([self._choice(index, content, entries, None)]))
        if calls:
            chunks.append(self._chunk([{"index": index, "delta": {"tool_calls": calls}, "logprobs": None,
                                        "finish_reason": None}]))
        return chunks

    def _choice(self, index: int, text: str, entries: list[dict], reason: str | None) -> dict:
        want = self.job.top_logprobs is not None
        if self.job.kind == "chat":
            delta = {"content": text} if text or reason is None else {}
            return {"index": index, "delta": delta,
                    "logprobs": chat_logprobs(entries) if want and entries else None, "finish_reason": reason}
        at = self.text_offset.get(index, 0)
        logprobs = completion_logprobs(entries, at) if want and entries else None
        self.text_offset[index] = at + len(text)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
