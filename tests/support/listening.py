"""Serve an app over real HTTP on 127.0.0.1 from the test's own event loop: its lifespan
(start-up to ready, as `asgi.serving`), then uvicorn listening on a free port. For what an
in-memory transport cannot show: a streamed answer arriving piece by piece, a client that
disconnects, the `openai` client over a real socket."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI

from tests.support.asgi import serving


@contextlib.asynccontextmanager
async def listening(app: FastAPI) -> AsyncIterator[str]:
    """The server's base URL while it listens."""
    async with serving(app):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)  # as `Server.serve` sets it ("off")
        await server.startup()  # returns once the socket listens
        try:
            port = server.servers[0].sockets[0].getsockname()[1]
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await server.shutdown()
