"""The fronts' failover loops, free of Ray and of any wire format: a streaming call relayed event by event and re-sent
to a live router replica when the one serving it dies, and a unary call retried the same way. The caller passes how
to start a call, how to tell a lost replica from the request's own failure (grpc_front.replica_lost), and what to
log; the resume rule is router_service/resume_streak.py, what to re-send is the progress object's
(openai_continuation.OpenAIProgress for the OpenAI API).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from .event_batches import flattened
from .resume_streak import ResumeStreak

T = TypeVar("T")


class Progress(Protocol):
    events: int  # events relayed so far (only grows)

    @property
    def done(self) -> bool: ...

    def fresh(self, event: Any) -> bool: ...

    def record(self, event: Any) -> None: ...

    def next_job(self) -> Any: ...


async def first_then_rest(responses, first_wait_s: float | None) -> AsyncIterator:
    """The events of a Serve streaming call, the first item awaited for at most `first_wait_s` (None: unbounded).
    An item that is a list is a batch of events (router_service/event_batches.py): its events are yielded one by
    one."""
    iterator = responses.__aiter__()
    try:
        first = await asyncio.wait_for(iterator.__anext__(), first_wait_s)
    except StopAsyncIteration:
        return
    for event in flattened(first):
        yield event
    async for message in iterator:
        for event in flattened(message):
            yield event


async def resumed_events(start: Callable[[Any], Any], progress: Progress, lost: Callable[[BaseException], bool],
                         streak: ResumeStreak, note: Callable[[BaseException, int], None],
                         bound_first: bool = True) -> AsyncIterator:
    """Every event of one request, each once, across as many calls as its router replicas' deaths take.

    start(job) begins a streaming call (iterable; `cancel()` lets it go); each call is sent progress.next_job(). A
    call that fails is re-sent after the streak's backoff when `lost(error)` says its replica died and the streak
    allows; otherwise the error is raised here, after the events before it. A failure after every choice's final
    event ends the stream quietly: the client has everything. Closing this iterator (the client went away) cancels
    the call in flight. bound_first=False: a re-sent call's first event is awaited without the streak's bound (a
    call whose first event comes only at its end, as best_of's, is not a lost one for taking long)."""
    while True:
        call = start(progress.next_job())
        finished = False
        try:
            async for event in first_then_rest(call, streak.first_wait(None) if bound_first else None):
                if progress.fresh(event):
                    progress.record(event)
                    yield event
            finished = True
            return
        except Exception as exc:  # a cancel (client gone) is a CancelledError: straight to the finally
            if progress.done:
                return
            backoff = streak.failed(progress.events)
            if backoff is None or not lost(exc):
                raise
            note(exc, streak.failures)
        finally:
            if not finished:
                call.cancel()  # best effort and idempotent; a no-op for a call that already failed
        await asyncio.sleep(backoff)


async def retried(call: Callable[[], Awaitable[T]], lost: Callable[[BaseException], bool], streak: ResumeStreak,
                  note: Callable[[BaseException, int], None]) -> T:
    """A unary call's result, re-sent (a fresh call each time) while its replica is lost and the streak allows."""
    while True:
        try:
            return await call()
        except Exception as exc:
            backoff = streak.failed(0)
            if backoff is None or not lost(exc):
                raise
            note(exc, streak.failures)
        await asyncio.sleep(backoff)
