"""Merging a request's choice streams (router_service/choice_streams.py): every event once, in arrival order per
source; an error in one source ends the merge and closes the others; closing the merge closes every source."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from expertmesh.router_service.choice_streams import merged


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


class Source:
    def __init__(self, events, delay=0.0, fail_after=None):
        self.events, self.delay, self.fail_after, self.closed = events, delay, fail_after, False

    async def stream(self):
        try:
            for k, event in enumerate(self.events):
                if self.fail_after is not None and k == self.fail_after:
                    raise ValueError("boom")
                await asyncio.sleep(self.delay)
                yield event
        finally:
            self.closed = True


def test_every_event_once_in_order_per_source():
    sources = [Source(list(range(5)), 0.001), Source(list("abc"), 0.002), Source([])]

    async def main():
        return [x async for x in merged([s.stream() for s in sources])]

    got = run(main())
    assert [e for i, e in got if i == 0] == list(range(5))
    assert [e for i, e in got if i == 1] == list("abc")
    assert len(got) == 8 and all(s.closed for s in sources)


def test_an_error_in_one_source_is_raised_and_closes_the_others():
    slow = Source(list(range(100)), 0.01)
    failing = Source([1, 2, 3], 0.001, fail_after=2)

    async def main():
        seen = []
        with pytest.raises(ValueError):
            async for item in merged([slow.stream(), failing.stream()]):
                seen.append(item)
        await asyncio.sleep(0)
        return seen

    seen = run(main())
    assert [e for i, e in seen if i == 1] == [1, 2]
    assert slow.closed


def test_closing_the_merge_closes_every_source():
    sources = [Source(list(range(100)), 0.005) for _ in range(3)]

    async def main():
        async with contextlib.aclosing(merged([s.stream() for s in sources])) as events:
            async for _ in events:
                break

    run(main())
    assert all(s.closed for s in sources)
