"""The HTTP front's failover (router_service/http_front.py): an OpenAI generation whose router replica dies resumes on
a live one, streamed or not, and a unary call (tokenize, detokenize, the cluster state) is retried there, as the gRPC
front does for Generate (grpc_front.py). The rule is shared: resume_streak.py decides when to give up, resuming.py
runs the loop, openai_continuation.py builds the continuing job; this only binds them to a Serve handle.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .grpc_front import replica_lost
from .log_limit import LogRateLimit
from .openai_api import OpenAIJob
from .openai_continuation import OpenAIProgress, with_resumable_seed
from .resume_streak import ResumeStreak
from .resuming import resumed_events, retried

T = TypeVar("T")
log = logging.getLogger(__name__)
_warnings = LogRateLimit()


class ResumingCall:
    """An OpenAIGenerate call as the front uses a Serve streaming call (iterate it; `cancel()` lets it go) that
    re-sends itself to a live router replica when the one serving it dies; its events reach the front once each."""

    def __init__(self, stream_handle, job: OpenAIJob, streak: ResumeStreak | None = None):
        self._handle = stream_handle
        self.progress = OpenAIProgress(with_resumable_seed(job))
        self._current = None  # the Serve call in flight
        # best_of streams nothing until its candidates end: its first event's wait is no sign of a lost replica.
        self._events = resumed_events(self._start, self.progress, replica_lost, streak or ResumeStreak(),
                                      self._note, bound_first=job.best_of is None)

    def _start(self, job: OpenAIJob):
        self._current = self._handle.OpenAIGenerate.remote(job)
        return self._current

    def __aiter__(self):
        return self._events

    def cancel(self) -> None:
        """The client went away, or the front is done: cancel the call in flight (idempotent)."""
        if self._current is not None:
            self._current.cancel()

    def _note(self, exc: BaseException, failures: int) -> None:
        delivered = sum(len(ids) for ids in self.progress.delivered.values())
        dropped = _warnings.admit(f"resume:{type(exc).__name__}")
        if dropped is not None:
            more = f" ({dropped} more like it dropped)" if dropped else ""
            log.warning("router replica lost mid-stream (%s, HTTP); resuming after %d tokens, attempt %d%s",
                        type(exc).__name__, delivered, failures, more)


async def unary(call: Callable[[], Awaitable[T]], streak: ResumeStreak | None = None) -> T:
    """A read-only unary call (a fresh Serve call each try), retried on a live router replica when its replica dies."""
    return await retried(call, replica_lost, streak or ResumeStreak(), _note_retry)


def _note_retry(exc: BaseException, failures: int) -> None:
    dropped = _warnings.admit(f"retry:{type(exc).__name__}")
    if dropped is not None:
        log.warning("router replica lost under a unary call (%s, HTTP); retrying, attempt %d", type(exc).__name__,
                    failures)
