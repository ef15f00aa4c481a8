"""Generation events sent from a router replica to a front in batches, not one Serve stream item each.

Every item of a Serve streaming call is a Ray object crossing processes: serialised, reported to its owner, read by
the front's handle and awaited there, a few hundred microseconds of CPU on each side. A generation yields one event
per token, so at 32 clients on the 2-core box the relay itself competed with the forward for the cores
(docs/benchmarks/peer.md). Batching changes how often the stream crosses, never what crosses: every event is sent,
in order, once.

- A streamed request (`hold_s` 0) sends each event as soon as it is ready, together with whatever else is ready
  then: under light load one event per item, under heavy load whatever queued while the front was busy.
- A non-streamed request (`hold_s` > 0) holds events up to `hold_s` after the first one of a batch: the client sees
  nothing before the end anyway, and a batch at least every `hold_s` keeps the front's resume point (the tokens it
  has; router_service/openai_continuation.py) at most that far behind if the replica dies.

The source's error (a refusal, a failed step) is raised after the events before it were sent, as before. Pure asyncio:
no Ray; tests/unit/test_event_batches.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

_END = object()


async def batched_events(events: AsyncIterator[Any], hold_s: float = 0.0) -> AsyncIterator[list[Any]]:
    """The events of `events`, in order, as lists (see the module docstring). Closing this generator (the caller
    cancelled) stops reading `events` and closes it."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for event in events:
                queue.put_nowait((event, None))
            queue.put_nowait((_END, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # delivered to the reader, after the events before it
            queue.put_nowait((_END, exc))

    loop = asyncio.get_running_loop()
    task = loop.create_task(pump())
    try:
        while True:
            event, error = await queue.get()
            batch: list[Any] = []
            deadline = loop.time() + hold_s
            while event is not _END:
                batch.append(event)
                if not queue.empty():
                    event, error = queue.get_nowait()
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    event, error = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    break
            if batch:
                yield batch
            if event is _END:
                if error is not None:
                    raise error
                return
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # the source is closed (its finally blocks ran) before this generator ends
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def flattened(message: Any) -> list[Any]:
    """A front's view of one stream item: a batch (list) is its events; anything else is one event."""
    return message if isinstance(message, list) else [message]
