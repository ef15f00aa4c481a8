"""A neutral OpenAI-compatible load client for `bench serve --peer`: the same code and the same request bodies for
every server (plain aiohttp, no server's own client library), `/v1/completions`, greedy, a fixed max_tokens.

Fixed length: `ignore_eos` is sent only to a server that accepts it (probed once: a server that refuses unknown
fields answers 4xx), and the tokens counted are the server's `usage.completion_tokens`, so a server that stops early
at an end-of-sequence token is billed only what it generated. Each level's record says whether every request got
exactly max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from ..measure import percentile

REQUEST_TIMEOUT_S = 900.0


@dataclass
class Reply:
    """One request as the client saw it."""

    started: float
    finished: float = 0.0
    first_token: float | None = None  # streamed only: arrival of the first chunk carrying text
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Target:
    """A server under test: its base URL (http://host:port), the model id it lists, and whether it takes
    ignore_eos (filled by `probe`)."""

    name: str
    base_url: str
    model: str | None = None
    ignore_eos: bool = False
    notes: list[str] = field(default_factory=list)


def body(target: Target, prompt: str, max_tokens: int, stream: bool) -> dict:
    """The request every server gets: the same fields, plus ignore_eos where the server takes it."""
    request: dict = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    if target.model is not None:
        request["model"] = target.model
    if stream:
        request["stream"] = True
        request["stream_options"] = {"include_usage": True}
    if target.ignore_eos:
        request["ignore_eos"] = True
    return request


async def probe(session: aiohttp.ClientSession, target: Target) -> None:
    """Fill target.model from /v1/models and target.ignore_eos from one short request carrying it."""
    async with session.get(f"{target.base_url}/v1/models") as resp:
        resp.raise_for_status()
        models = (await resp.json())["data"]
    if not models:
        raise RuntimeError(f"{target.name}: /v1/models lists no model")
    target.model = models[0]["id"]
    trial = {"prompt": "def", "max_tokens": 2, "temperature": 0.0, "model": target.model, "ignore_eos": True}
    async with session.post(f"{target.base_url}/v1/completions", json=trial) as resp:
        text = await resp.text()
        if resp.status == 200:
            target.ignore_eos = True
        elif 400 <= resp.status < 500:
            target.ignore_eos = False
            target.notes.append(f"ignore_eos refused ({resp.status}: {text[:200]}); completion tokens counted")
        else:
            raise RuntimeError(f"{target.name}: probe request failed with HTTP {resp.status}: {text[:500]}")


async def complete(session: aiohttp.ClientSession, target: Target, prompt: str, max_tokens: int,
                   stream: bool) -> Reply:
    """One completion; never raises (an error is recorded on the reply, so one request cannot end a level)."""
    reply = Reply(started=time.perf_counter())
    try:
        async with session.post(f"{target.base_url}/v1/completions",
                                json=body(target, prompt, max_tokens, stream)) as resp:
            if resp.status != 200:
                reply.error = f"HTTP {resp.status}"
            elif stream:
                await _read_stream(resp, reply)
            else:
                _take_usage(await resp.json(), reply)
    except asyncio.TimeoutError:
        reply.error = "timeout"
    except aiohttp.ClientError as exc:
        reply.error = type(exc).__name__
    except (ValueError, KeyError) as exc:  # a malformed body
        reply.error = f"bad response: {type(exc).__name__}"
    reply.finished = time.perf_counter()
    return reply


def _take_usage(message: dict, reply: Reply) -> None:
    usage = message.get("usage") or {}
    if usage.get("completion_tokens") is not None:
        reply.completion_tokens = int(usage["completion_tokens"])
        reply.prompt_tokens = usage.get("prompt_tokens")
    for choice in message.get("choices") or []:
        if choice.get("finish_reason"):
            reply.finish_reason = choice["finish_reason"]


async def _read_stream(resp: aiohttp.ClientResponse, reply: Reply) -> None:
    """Server-sent events: `data: {...}` lines, maybe ending with `data: [DONE]` (not every server sends it)."""
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        message = json.loads(data)
        if "error" in message:
            reply.error = "stream error"
            return
        if reply.first_token is None and any(c.get("text") for c in message.get("choices") or []):
            reply.first_token = time.perf_counter()
        _take_usage(message, reply)


async def run_level(target: Target, prompts: list[list[str]], max_tokens: int, stream: bool) -> tuple[list[Reply],
                                                                                                       float]:
    """len(prompts) concurrent clients, client i sending prompts[i] one after the other; all replies and the wall
    time from the first request to the last reply. One session, one event loop: on a small machine a thread per
    client would bill the client's own overhead to the server under test."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        replies: list[list[Reply]] = [[] for _ in prompts]

        async def client(i: int) -> None:
            for prompt in prompts[i]:
                replies[i].append(await complete(session, target, prompt, max_tokens, stream))

        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(len(prompts))))
        return [r for per in replies for r in per], time.perf_counter() - started


async def probe_target(target: Target) -> Target:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await probe(session, target)
    return target


def level_record(replies: list[Reply], wall_s: float, max_tokens: int) -> dict:
    """A level's figures: tokens/s over the level's wall time (server-counted completion tokens), time to first
    token (streamed), whether every request got exactly max_tokens, and errors by kind."""
    ok = [r for r in replies if r.error is None]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    ttfts = [1000.0 * (r.first_token - r.started) for r in ok if r.first_token is not None]
    latencies = [1000.0 * (r.finished - r.started) for r in ok]
    errors: dict[str, int] = {}
    for r in replies:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    prompt_tokens = sorted(r.prompt_tokens for r in ok if r.prompt_tokens is not None)
    return {
        "requests": len(replies),
        "completed": len(ok),
        "completion_tokens": tokens,
        "exact_max_tokens": sum(1 for r in ok if r.completion_tokens == max_tokens),
        "uncounted": sum(1 for r in ok if r.completion_tokens is None),
        "wall_s": round(wall_s, 4),
        "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 and ok else None,
        "ttft_p50_ms": round(percentile(ttfts, 50), 3) if ttfts else None,
        "ttft_p99_ms": round(percentile(ttfts, 99), 3) if ttfts else None,
        "latency_p50_ms": round(percentile(latencies, 50), 3) if latencies else None,
        "prompt_tokens_median": prompt_tokens[len(prompt_tokens) // 2] if prompt_tokens else None,
        "errors": errors,
    }
