"""The HTTP front's failover (router_service/http_resume.py) through the real aiohttp front against a fake router
deployment whose replicas die mid-call (no Ray): a streamed or non-streamed OpenAI generation, n > 1, resumes on a
live replica and the client gets exactly the undisturbed response (no chunk repeated or lost, usage right); the
re-sent jobs carry what was relayed; a request error is not retried; resuming is bounded; tokenize is retried."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from expertmesh.router_service import http_resume
from expertmesh.router_service.config import ServerConfig
from expertmesh.router_service.event_batches import batched_events
from expertmesh.router_service.http_front import start_http_front
from expertmesh.router_service.proto_mapping import ApiError
from expertmesh.router_service.resume_streak import ResumeStreak

MODEL = "m"
TOTAL = 5  # tokens per choice


class DyingReplicas:
    """OpenAIGenerate as the deployment streams it (choice i: tokens i*10+1 .. i*10+TOTAL, then done), honouring a
    continued job's resumed / finished choices; call k dies after dies_after[k] events (None: never)."""

    def __init__(self, dies_after: list[int | None], fail_first: list[BaseException] = (),
                 hold_s: float | None = None):
        self.dies_after = dies_after
        self.hold_s = hold_s
        self.jobs: list = []
        self.cancelled: list[bool] = []
        self.unary_calls = 0
        self.fail_first = list(fail_first)

    def options(self, **_):
        return self

    @property
    def OpenAIGenerate(self):  # noqa: N802
        return self

    @property
    def OpenAITokenize(self):  # noqa: N802
        handle = self

        class Unary:
            def remote(self, text, messages):
                async def reply():
                    handle.unary_calls += 1
                    if handle.fail_first:
                        raise handle.fail_first.pop(0)
                    return [1, 2, 3]
                return reply()

        return Unary()

    @property
    def context_length(self):
        class Unary:
            def remote(self):
                async def reply():
                    return 64
                return reply()

        return Unary()

    def remote(self, job):
        self.jobs.append(job)
        self.cancelled.append(False)
        call, handle = len(self.jobs) - 1, self

        class Call:
            def cancel(self):
                handle.cancelled[call] = True

            def __aiter__(self):
                events = handle._events(call, job)
                # As the deployment sends them: in batches (router_service/event_batches.py), when asked.
                return events if handle.hold_s is None else batched_events(events, handle.hold_s)

        return Call()

    async def _events(self, call: int, job):
        dies = self.dies_after[call] if call < len(self.dies_after) else None
        sent = 0

        def events():
            for i in range(job.num_choices):
                if i in job.finished:
                    continue
                start = len(job.resumed[i]) if job.resumed else 0
                for t in range(start + 1, TOTAL + 1):
                    yield {"token": {"index": i, "ids": [i * 10 + t], "text": f"<{i * 10 + t}>", "logprobs": None,
                                     "prompt_tokens": 2}}
                yield {"done": {"index": i, "finish_reason": "length", "prompt_tokens": 2, "completion_tokens": TOTAL,
                                "tokens_per_expert": {}, "rerouted": 0, "degraded": 0, "dropped": 0, "shed": 0}}

        for event in events():
            if dies is not None and sent == dies:
                raise ActorUnavailableError("Actor is unavailable.", None)
            await asyncio.sleep(0)
            sent += 1
            yield event
        if dies is not None:
            raise ActorDiedError()


def run(handle, check):
    async def main():
        runner, port = await start_http_front(handle, ServerConfig(http_port=0), MODEL)
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
                return await check(client)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def body(stream: bool, n: int = 2) -> dict:
    out = {"model": MODEL, "prompt": "hi", "max_tokens": TOTAL, "n": n, "stream": stream, "temperature": 0.7}
    return out | ({"stream_options": {"include_usage": True}} if stream else {})


async def streamed(client) -> tuple[dict[int, str], dict, list[str]]:
    reply = await client.post("/v1/completions", json=body(True))
    assert reply.status == 200
    frames = (await reply.text()).split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(f[len("data: "):]) for f in frames[:-2]]
    assert not any("error" in c for c in chunks), chunks
    texts: dict[int, str] = {}
    reasons = []
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                reasons.append(choice["finish_reason"])
    return texts, chunks[-1]["usage"], reasons


async def whole(client) -> dict:
    reply = await client.post("/v1/completions", json=body(False))
    assert reply.status == 200, await reply.text()
    return await reply.json()


EXPECTED_TEXT = {i: "".join(f"<{i * 10 + t}>" for t in range(1, TOTAL + 1)) for i in range(2)}
USAGE = {"prompt_tokens": 2, "completion_tokens": 2 * TOTAL, "total_tokens": 2 + 2 * TOTAL,
         "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("hold_s", [None, 0.0])
@pytest.mark.parametrize("dies_after", [[3], [0], [3, 0, 4], [6], [11]])
def test_a_stream_whose_replica_dies_resumes_with_every_chunk_once(dies_after, hold_s):
    handle = DyingReplicas(dies_after, hold_s=hold_s)
    texts, usage, reasons = run(handle, streamed)
    assert texts == EXPECTED_TEXT and usage == USAGE and reasons == ["length", "length"]
    assert len(handle.jobs) == len(dies_after) + 1
    assert handle.cancelled[:-1] == [True] * len(dies_after)  # each lost call let go of
    first = handle.jobs[0]
    assert first.seed is not None  # a sampled job gets a seed before its first call, so a resumed one draws the same
    assert all(job.seed == first.seed and job.prompts == first.prompts for job in handle.jobs)


def test_the_continued_job_carries_what_was_relayed():
    handle = DyingReplicas([7])  # choice 0's 5 tokens and done, then choice 1's first token
    run(handle, streamed)
    again = handle.jobs[1]
    assert again.resumed == ((1, 2, 3, 4, 5), (11,)) and again.finished == (0,) and again.echoed == ()


@pytest.mark.parametrize("hold_s", [None, 0.0, 0.5])
@pytest.mark.parametrize("dies_after", [[4], [0, 0], [11]])
def test_a_non_streamed_request_whose_replica_dies_is_completed_on_a_live_one(dies_after, hold_s):
    undisturbed = run(DyingReplicas([]), whole)
    handle = DyingReplicas(dies_after, hold_s=hold_s)
    got = run(handle, whole)
    assert [c["text"] for c in got["choices"]] == [EXPECTED_TEXT[0], EXPECTED_TEXT[1]]
    assert got["choices"] == undisturbed["choices"] and got["usage"] == USAGE
    assert len(handle.jobs) == len(dies_after) + 1


def test_a_request_error_is_not_retried():
    class Refusing(DyingReplicas):
        async def _events(self, call, job):
            raise ApiError("INVALID_ARGUMENT", "max_tokens: too many")
            yield

    handle = Refusing([])

    async def check(client):
        reply = await client.post("/v1/completions", json=body(False))
        return reply.status, await reply.json()

    status, error = run(handle, check)
    assert status == 400 and error["error"]["param"] == "max_tokens" and len(handle.jobs) == 1


def test_resuming_is_bounded_then_the_stream_ends_with_an_error_event(monkeypatch):
    import expertmesh.router_service.http_resume as module

    original = module.ResumingCall.__init__

    def short(self, handle, job, streak=None):
        original(self, handle, job, ResumeStreak(max_resumes=3, backoff_s=0.001))

    monkeypatch.setattr(module.ResumingCall, "__init__", short)
    handle = DyingReplicas([1] * 10)  # progress each time, and death each time

    async def check(client):
        reply = await client.post("/v1/completions", json=body(True))
        return (await reply.text()).split("\n\n")

    frames = run(handle, check)
    errors = [json.loads(f[6:]) for f in frames if f.startswith("data: {\"error\"")]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "service_unavailable"
    assert len(handle.jobs) == 4


def test_tokenize_is_retried_on_a_live_replica():
    handle = DyingReplicas([], fail_first=[ActorDiedError(), ActorUnavailableError("gone", None)])

    async def check(client):
        reply = await client.post("/tokenize", json={"prompt": "hi"})
        return reply.status, await reply.json()

    status, got = run(handle, check)
    assert status == 200 and got["tokens"] == [1, 2, 3] and handle.unary_calls == 3


def test_unary_retry_gives_up_on_a_request_error():
    calls = []

    async def refused():
        calls.append(1)
        raise ApiError("INVALID_ARGUMENT", "tokens: bad")

    with pytest.raises(ApiError):
        asyncio.run(http_resume.unary(refused))
    assert len(calls) == 1
