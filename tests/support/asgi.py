"""Run an app in-process: its lifespan, start-up to ready, and an httpx client on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI


@contextlib.asynccontextmanager
async def serving(app: FastAPI, wait_ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        if wait_ready:
            startup: asyncio.Task[None] = app.state.startup_task
            await startup
            await app.state.service.engine.wait_ready()
            readiness = app.state.service.readiness()
            assert readiness.ready, readiness
        # As under uvicorn: an unhandled error is a logged 500, not raised into the client.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


async def post_directly(
    app: Any,
    path: str,
    headers: list[tuple[bytes, bytes]],
    receive: Callable[[], Awaitable[dict[str, Any]]],
) -> tuple[int, dict[str, str]]:
    """Drive the ASGI app with a POST to `path` with `headers`, below any HTTP client:
    `receive` decides what (if anything) of the body arrives. The response's status and
    headers."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    start_message = next(m for m in sent if m["type"] == "http.response.start")
    return start_message["status"], {k.decode(): v.decode() for k, v in start_message["headers"]}
