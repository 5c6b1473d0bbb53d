"""The batch client's bookkeeping, with a scripted transport (`_post`) and no server:
`stop` or `abort` while a refused pack is being resent one item at a time (the singles
already answered are yielded, the rest are unfinished, each item counted once), and what
the concurrency controller is told is in flight."""

from __future__ import annotations

import asyncio

import orjson

from app.batchclient import BatchClient, ClientOptions, Item, Success
from app.batchclient.attempt import Attempt
from app.batchclient.items import Request


class ScriptedClient(BatchClient):
    """Refuses any pack (413); answers a single once the test lets it."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9", ClientOptions(concurrency=4, inputs_per_request=3))
        self.single_in_flight = asyncio.Event()
        self.answer_single = asyncio.Event()

    async def _post(self, request: Request) -> Attempt:
        ticket = self.controller.on_send()
        if len(request.items) > 1:
            error = orjson.dumps({"error": {"type": "too_large", "message": "pack refused"}})
            return Attempt(413, error, None, 0.001, ticket)
        self.single_in_flight.set()
        await self.answer_single.wait()
        body = orjson.dumps({"model": "m", "outputs": [[0.0]], "usage": {"inputs": 1}})
        return Attempt(200, body, None, 0.001, ticket)


async def test_stop_during_a_split_pack_yields_what_was_answered() -> None:
    items = [Item(index, {"inputs": f"text {index}"}) for index in range(3)]
    async with ScriptedClient() as client:

        async def run() -> list[object]:
            return [result async for result in client.infer_many(items)]

        running = asyncio.create_task(run())
        async with asyncio.timeout(10.0):  # only keeps a regression from hanging the suite
            await client.single_in_flight.wait()  # the first single is being answered
            client.stop()
            client.answer_single.set()
            results = await running
    assert [r.id for r in results if isinstance(r, Success)] == [0]
    stats = client.stats()
    assert (stats.lines_ok, stats.lines_failed, stats.lines_unfinished) == (1, 0, 2)


class HangingSingleClient(BatchClient):
    """Refuses any pack (413); answers a single at once, but never the one reading HANG."""

    HANG = "hang"

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9", ClientOptions(concurrency=4, inputs_per_request=3))
        self.hanging = asyncio.Event()

    async def _post(self, request: Request) -> Attempt:
        ticket = self.controller.on_send()
        if len(request.items) > 1:
            error = orjson.dumps({"error": {"type": "too_large", "message": "pack refused"}})
            return Attempt(413, error, None, 0.001, ticket)
        if request.items[0].body["inputs"] == self.HANG:
            self.hanging.set()
            await asyncio.Event().wait()  # until `abort` cancels it
        body = orjson.dumps({"model": "m", "outputs": [[0.0]], "usage": {"inputs": 1}})
        return Attempt(200, body, None, 0.001, ticket)


async def test_abort_during_a_split_pack_yields_what_was_answered() -> None:
    """`abort` cancels the single in flight; the singles answered before it were dropped
    with it (counted unfinished, never yielded), so a rerun sent them again."""
    texts = ["text 0", HangingSingleClient.HANG, "text 2"]
    items = [Item(index, {"inputs": text}) for index, text in enumerate(texts)]
    async with HangingSingleClient() as client:

        async def run() -> list[object]:
            return [result async for result in client.infer_many(items)]

        running = asyncio.create_task(run())
        # The stand-in never answers item 1 on its own: only `abort` ends the run, so the
        # bound keeps a regression from hanging the suite.
        async with asyncio.timeout(10.0):
            await client.hanging.wait()  # item 0 answered, item 1 in flight, item 2 not sent
            client.abort()
            results = await running
    assert [r.id for r in results if isinstance(r, Success)] == [0]
    stats = client.stats()
    assert (stats.lines_ok, stats.lines_failed, stats.lines_unfinished) == (1, 0, 2)


class InstantClient(BatchClient):
    """Answers every request at once, so at most one is ever on the wire."""

    async def _post(self, request: Request) -> Attempt:
        ticket = self.controller.on_send()
        body = orjson.dumps({"model": "m", "outputs": [[0.0]], "usage": {"inputs": 1}})
        return Attempt(200, body, None, 0.001, ticket)


async def test_requests_held_back_by_the_rate_do_not_grow_the_concurrency_limit() -> None:
    """Waiting for a rate token, requests hold window slots; counting them as in flight
    made every success look like a full window, and the limit grew to its maximum."""
    options = ClientOptions(concurrency=64, rate=500.0)
    async with InstantClient("http://127.0.0.1:9", options) as client:
        start = client.controller.limit  # the controller's initial limit
        items = [Item(index, {"inputs": "x"}) for index in range(12)]
        answered = [result async for result in client.infer_many(items)]
    assert len(answered) == 12
    assert start < len(answered)  # enough requests to have grown it, had they counted
    assert client.controller.snapshot().highest_limit == start
