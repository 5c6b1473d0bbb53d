"""The SSE response: one write per item its producer yields, the item that ends with
`[DONE]` also ending the body (no empty last write), and a producer that stops without
`[DONE]` still gets its body ended."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from app.api.sse import DONE, EventStreamResponse, event

pytestmark = pytest.mark.asyncio


async def _sent_by(frames: list[bytes]) -> list[dict[str, Any]]:
    async def producer() -> AsyncGenerator[bytes]:
        for frame in frames:
            yield frame

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    # `receive` never returns: a response that waited for the client to leave would never
    # end, so the bound makes that a failure rather than a hung suite.
    async with asyncio.timeout(10.0):
        await EventStreamResponse(producer())(scope, receive, send)  # type: ignore[arg-type]
    return sent


async def test_the_frame_with_done_ends_the_body_in_the_same_write() -> None:
    first, last = event({"a": 1}), event({"b": 2}) + DONE
    sent = await _sent_by([first, last])
    assert sent[0]["type"] == "http.response.start"
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(first, True), (last, False)]


async def test_a_producer_that_ends_without_done_still_ends_the_body() -> None:
    sent = await _sent_by([event({"a": 1})])
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (event({"a": 1}), True),
        (b"", False),
    ]
