"""Several generation streams of one request (n / best_of choices, a batch of prompts) as one stream. Pure asyncio
(no Ray, no torch).

Each source stream is drained by its own task into one queue, so the choices advance together in the batcher's
shared steps and their events reach the client in the order they were made. Closing the merged stream (the client
went away, or an error) cancels the tasks, and each task closes its source stream, which frees its sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Yields (source index, event) from every stream as they come; ends when all have ended; an exception in any
    source is raised here (after the events before it) and closes the others."""
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def drain(i: int, stream: AsyncIterator) -> None:
        try:
            async with contextlib.aclosing(stream) as events:
                async for event in events:
                    queue.put_nowait((i, event))
            queue.put_nowait((i, finished))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, event = await queue.get()
            if event is finished:
                running -= 1
            elif isinstance(event, Exception):
                raise event
            else:
                yield i, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
