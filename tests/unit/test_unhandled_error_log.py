"""A fault no handler answers is logged with the request's path as `repr` shows it: the
path is decoded from its %-escapes, and a `%0A` in it would otherwise start a log line of
the client's own making in the plain-text logs (`ServerTimingMiddleware`)."""

from __future__ import annotations

import logging

import pytest
from starlette.types import Message, Receive, Scope, Send

from app.api.middleware import ServerTimingMiddleware

FORGED = "/infer\n2024-01-01 00:00:00,000 CRITICAL app.service: engine compromised"


async def failing(scope: Scope, receive: Receive, send: Send) -> None:
    raise RuntimeError("a fault of the server's own")


async def test_a_path_with_a_line_end_cannot_forge_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    app = ServerTimingMiddleware(failing, is_draining=lambda: False)
    scope: Scope = {"type": "http", "method": "POST", "path": FORGED, "headers": []}
    with caplog.at_level(logging.ERROR, logger="app.api.middleware"):
        await app(scope, receive, send)

    assert sent[0]["status"] == 500
    [record] = caplog.records
    line = record.getMessage()
    assert "\n" not in line
    assert line == f"unhandled error on POST {FORGED!r}"


async def test_the_line_names_envoys_request_id(caplog: pytest.LogCaptureFixture) -> None:
    """Which request it was, in the proxy's access log too: Envoy's `x-request-id`, as
    `repr` shows it (the client may send one of its own)."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    app = ServerTimingMiddleware(failing, is_draining=lambda: False)
    headers = [(b"x-request-id", b"5f0c-41a7")]
    scope: Scope = {"type": "http", "method": "POST", "path": "/infer", "headers": headers}
    with caplog.at_level(logging.ERROR, logger="app.api.middleware"):
        await app(scope, receive, send)
    assert sent[0]["status"] == 500
    [record] = caplog.records
    assert record.getMessage() == "unhandled error on POST '/infer' x-request-id='5f0c-41a7'"
