"""The concurrency window and the client's handling of a failing item source."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from app.batchclient import BatchClient, Item, Success
from app.batchclient.pacing import AimdController
from app.batchclient.window import Window


async def test_window_admits_up_to_the_limit_and_hands_slots_over_in_order() -> None:
    window = Window(AimdController(2, initial=2))
    await window.acquire()
    await window.acquire()
    third = asyncio.create_task(window.acquire())
    fourth = asyncio.create_task(window.acquire())
    await asyncio.sleep(0)
    assert not third.done() and window.in_flight == 2
    window.release()
    await asyncio.sleep(0)
    assert third.done() and not fourth.done()
    fourth.cancel()  # a waiter that gives up leaves no slot taken
    await asyncio.gather(fourth, return_exceptions=True)
    window.release()
    window.release()
    assert window.in_flight == 0


async def test_a_cut_limit_applies_as_holders_leave() -> None:
    controller = AimdController(4, initial=4)
    window = Window(controller)
    for _ in range(4):
        await window.acquire()
    controller.on_congestion(controller.on_send())
    assert controller.limit == 2
    waiter = asyncio.create_task(window.acquire())
    window.release()
    window.release()
    await asyncio.sleep(0)
    assert not waiter.done()  # 2 still in flight: at the new limit
    window.release()
    await asyncio.sleep(0)
    assert waiter.done()
    assert window.in_flight == 2


async def test_a_failing_item_source_stops_the_run_and_is_raised() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"model": "m", "outputs": [[1.0]], "usage": {}})

    def items() -> Iterator[Item]:
        yield Item(1, {"inputs": "a"})
        yield Item(2, {"inputs": "b"})
        raise OSError("input vanished")

    seen: list[object] = []
    async with BatchClient("http://test", transport=httpx.MockTransport(answer)) as client:
        with pytest.raises(OSError, match="input vanished"):
            async for result in client.infer_many(items()):
                assert isinstance(result, Success)
                seen.append(result.id)
        stats = client.stats()
    # As on SIGTERM: what was sent is answered, the rest is left unfinished, none lost.
    assert len(seen) + stats.lines_unfinished == 2
