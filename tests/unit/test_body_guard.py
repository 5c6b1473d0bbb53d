"""The body guard's refusals are the client's doing: the request is answered 408/413 and is
never judged a slow request (the app behind the guard answered 400 to the broken body, and
the slow-request report recorded that 400, with the client's seconds as "unaccounted")."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from app.api.middleware import BodyGuardMiddleware
from app.timing import PhaseTimer


async def reads_its_body(scope: Scope, receive: Receive, send: Send) -> None:
    while (message := await receive())["type"] == "http.request" and message.get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 400, "headers": []})
    await send({"type": "http.response.body", "body": b"broken body"})


async def guarded(receive: Receive) -> tuple[list[Message], PhaseTimer]:
    timer = PhaseTimer()
    scope: dict[str, Any] = {"type": "http", "headers": [], "state": {"server_timing": timer}}
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    guard = BodyGuardMiddleware(reads_its_body, max_body_bytes=10, read_timeout_s=0.05)
    await guard(scope, receive, send)
    return sent, timer


@pytest.mark.parametrize("status", [408, 413])
async def test_a_refused_body_is_answered_by_the_guard_and_never_judged_slow(status: int) -> None:
    chunks = [b"x" * 20] if status == 413 else [b"{"]

    async def receive() -> Message:
        if chunks:
            return {"type": "http.request", "body": chunks.pop(), "more_body": True}
        await asyncio.Event().wait()  # a client that stalls: nothing more, ever
        raise AssertionError("unreachable")

    # Only the guard's read timeout (0.05 s) ends the 408 case; the bound keeps a guard that
    # stopped timing the read from hanging the suite.
    async with asyncio.timeout(10.0):
        sent, timer = await guarded(receive)
    assert sent[0]["status"] == status
    assert timer.latency_bound is False


async def test_a_whole_body_leaves_the_request_judged_as_usual() -> None:
    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    sent, timer = await guarded(receive)
    assert sent[0]["status"] == 400  # the app's own answer, passed through
    assert timer.latency_bound is True


async def test_a_content_length_of_thousands_of_digits_is_a_413_not_a_500() -> None:
    """Python's `int` refuses strings of over 4,300 digits: the guard raised, answered 500."""
    timer = PhaseTimer()
    declared = b"0" * 5000 + b"14"
    scope: dict[str, Any] = {
        "type": "http",
        "headers": [(b"content-length", declared)],
        "state": {"server_timing": timer},
    }
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    guard = BodyGuardMiddleware(reads_its_body, max_body_bytes=10, read_timeout_s=0.05)
    await guard(scope, receive, send)
    assert sent[0]["status"] == 413
