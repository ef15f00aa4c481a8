"""One OpenAI job's events (router_service/openai_responses.py shapes) from its plan (openai_requests.plan): the echo,
then the choices' generation streams, merged, each event naming its choice index; best_of's candidates collected and
the best n kept. Pure asyncio: the router deployment (deployment.py OpenAIGenerate) passes in its batcher's stream,
its scoring forward and its tokenizer, so this runs without Ray against a real batcher in tests.

A job re-sent after failover (router_service/openai_continuation.py) skips what its client already has: the choices
in `job.echoed` are not echoed again, those in `job.finished` are not run again, and the others continue after their
`job.resumed` tokens (already in the plan's requests as `resumed_ids`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import torch

from . import choice_streams, openai_requests
from .batching import GenerationRequest
from .openai_api import OpenAIJob


async def job_events(job: OpenAIJob, plan: openai_requests.Plan,
                     stream: Callable[[GenerationRequest], AsyncIterator],
                     score: Callable[[list[list[int]]], Awaitable[list[torch.Tensor]]],
                     decode: Callable[[list[int]], str | None], token_text: Callable[[int], str]
                     ) -> AsyncIterator[dict]:
    """stream(request): the batcher's events of one sequence (closing it cancels the sequence); score(prompts):
    each prompt's logits [S, V] (echo with logprobs); decode(ids): text or None (no tokenizer). A job with tools
    opens with {"tools": {"index": 0, "family"}} (the front parses calls in the syntax of this model's template),
    sent just before the first event, so a request the batcher refuses still fails before any event (the front
    answers it with its own HTTP status)."""
    events = _events(job, plan, stream, score, decode, token_text)
    async with contextlib.aclosing(events) as events:
        opened = job.tools is None
        async for event in events:
            if not opened:
                opened = True
                yield {"tools": {"index": 0, "family": plan.tool_family}}
            yield event


async def _events(job: OpenAIJob, plan: openai_requests.Plan, stream: Callable[[GenerationRequest], AsyncIterator],
                  score: Callable[[list[list[int]]], Awaitable[list[torch.Tensor]]],
                  decode: Callable[[list[int]], str | None], token_text: Callable[[int], str]
                  ) -> AsyncIterator[dict]:
    echoed, finished = set(job.echoed), set(job.finished)
    if job.echo and len(echoed) < job.num_choices:
        scored = [None] * len(plan.prompt_ids)
        if job.top_logprobs is not None:  # every prompt of the batch in one forward, between steps
            logits = await score(plan.prompt_ids)
            scored = [openai_requests.prompt_logprobs(x, ids, job.top_logprobs)  # x: [S, V]
                      for x, ids in zip(logits, plan.prompt_ids)]
        for p, ids in enumerate(plan.prompt_ids):
            text = plan.prompt_texts[p]
            if text is None:
                text = decode(ids) or ""
            for j in range(job.n):
                if p * job.n + j not in echoed:
                    yield openai_requests.echo_dict(p * job.n + j, text, ids, scored[p], token_text)
    if job.max_tokens == 0:
        for p, ids in enumerate(plan.prompt_ids):
            for j in range(job.n):
                if p * job.n + j not in finished:
                    yield openai_requests.empty_done(p * job.n + j, len(ids))
        return
    # Sequence i of plan.requests is choice i unless best_of (which never resumes, so `finished` is empty then).
    live = [i for i in range(len(plan.requests)) if i not in finished]
    streams = [stream(plan.requests[i]) for i in live]
    if job.best_of is not None:  # collect every candidate, keep the best n per prompt
        per_prompt = job.candidates
        candidates: list[list[dict]] = [[] for _ in streams]
        async with contextlib.aclosing(choice_streams.merged(streams)) as events:
            async for i, event in events:
                candidates[i].append(openai_requests.event_dict(event, token_text))
        for p in range(len(plan.prompt_ids)):
            mine = candidates[p * per_prompt:(p + 1) * per_prompt]
            kept = openai_requests.best_of(mine, job.n, keep_logprobs=job.top_logprobs is not None)
            for j, events_of_choice in enumerate(kept):
                for event in events_of_choice:
                    yield openai_requests.with_index(event, p * job.n + j)
        return
    prompt_tokens = [len(r.prompt_ids) for r in plan.requests]
    if len(streams) == 1:  # the common case without the merge's task and queue
        async with contextlib.aclosing(streams[0]) as events:
            async for event in events:
                yield openai_requests.event_dict(event, token_text, live[0], prompt_tokens[live[0]])
        return
    async with contextlib.aclosing(choice_streams.merged(streams)) as events:
        async for i, event in events:
            yield openai_requests.event_dict(event, token_text, live[i], prompt_tokens[live[i]])
