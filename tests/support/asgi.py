"""Run an app in-process: its lifespan, start-up to ready, and an httpx client on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI


async def loop_calm(app: FastAPI, timeout_s: float = 10.0) -> None:
    """Until the front end's loop-lag reading is back to zero: an in-process warm-up ran on
    this loop, and lag counts as waiting, so the first requests could be shed."""
    service = app.state.service
    give_up_at = asyncio.get_running_loop().time() + timeout_s
    while service.loop_lag.seconds > 0:
        assert asyncio.get_running_loop().time() < give_up_at, "the event loop never calmed"
        await asyncio.sleep(0.01)  # polling the lag reading, bounded


@contextlib.asynccontextmanager
async def serving(app: FastAPI, wait_ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        if wait_ready:
            startup: asyncio.Task[None] = app.state.startup_task
            await startup
            await app.state.service.engine.wait_ready()
            await loop_calm(app)
            readiness = app.state.service.readiness()
            assert readiness.ready, readiness
        # As under uvicorn: an unhandled error is a logged 500, not raised into the client.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client
