"""Run an app in-process: its lifespan, start-up to ready, and an httpx client on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

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
