"""Generation events batched for the trip from a router replica to a front (router_service/event_batches.py): every
event once and in order, batches of what is ready (streamed) or held up to a bound (non-streamed), the source's
error after the events before it, the source closed when the reader goes away. Pure asyncio, no Ray."""

from __future__ import annotations

import asyncio

import pytest

from expertmesh.router_service.event_batches import batched_events, flattened


async def _source(events, gap_s: float = 0.0, error: BaseException | None = None, closed: list | None = None):
    try:
        for event in events:
            if gap_s:
                await asyncio.sleep(gap_s)
            yield event
        if error is not None:
            raise error
    finally:
        if closed is not None:
            closed.append(True)


async def _collect(agen) -> list[list]:
    return [batch async for batch in agen]


def test_streamed_sends_at_once_and_batches_only_what_is_ready():
    async def main():
        # No gap: the source runs ahead of the reader, so ready events share batches; with a gap each goes alone.
        together = await _collect(batched_events(_source(range(20)), 0.0))
        alone = await _collect(batched_events(_source(range(4), gap_s=0.02), 0.0))
        return together, alone

    together, alone = asyncio.run(main())
    assert [e for b in together for e in b] == list(range(20)) and len(together) < 20
    assert alone == [[0], [1], [2], [3]]


def test_non_streamed_holds_events_up_to_the_bound():
    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        one = await _collect(batched_events(_source(range(5), gap_s=0.01), 5.0))
        # The end of the stream sends at once: the hold does not delay the last batch.
        took = loop.time() - started
        several = await _collect(batched_events(_source(range(6), gap_s=0.1), 0.15))
        return one, took, several

    one, took, several = asyncio.run(main())
    assert one == [[0, 1, 2, 3, 4]] and took < 1.0
    # ~2 events per 150 ms hold: about 3 batches (a slow box may split one more)
    assert [e for b in several for e in b] == list(range(6)) and 2 <= len(several) <= 5


@pytest.mark.parametrize("hold_s", [0.0, 1.0])
def test_the_sources_error_comes_after_the_events_before_it(hold_s):
    async def main():
        got = []
        with pytest.raises(ValueError, match="step failed"):
            async for batch in batched_events(_source(range(3), gap_s=0.01, error=ValueError("step failed")), hold_s):
                got.extend(batch)
        with pytest.raises(ValueError, match="refused"):  # an error before any event: nothing is sent first
            await _collect(batched_events(_source([], error=ValueError("refused")), hold_s))
        return got

    assert asyncio.run(main()) == [0, 1, 2]


def test_closing_the_reader_closes_the_source():
    async def main():
        closed: list = []
        batches = batched_events(_source(range(1000), gap_s=0.01, closed=closed), 0.0)
        first = await batches.__anext__()
        await batches.aclose()  # the client went away
        return first, closed

    first, closed = asyncio.run(main())
    assert first == [0] and closed == [True]


def test_a_front_flattens_batches_and_passes_single_events():
    assert flattened([{"token": 1}, {"done": 2}]) == [{"token": 1}, {"done": 2}]
    assert flattened({"token": 1}) == [{"token": 1}]
