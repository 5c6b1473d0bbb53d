"""The scheduling harness: the ASGI app with an in-process engine and a gated fake model
(tests/support/fake_model.py), so a test decides when a batch finishes; one dispatcher
thread, so holding it holds every batch. `start` serves it on settings `BASE` with
overrides; tests/integration/conftest.py's `harness` fixture is `start()`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from fastapi import FastAPI

from app.engine.core import EngineCore
from app.engine.inprocess import InProcessEngine
from app.main import create_app
from app.model_specs import ModelSpec
from app.service import Service
from app.settings import Settings
from tests.support.asgi import serving
from tests.support.fake_model import GatedLoader, GatedRunner

BASE = {
    "engine": "inprocess",
    "models": (ModelSpec(name="fake"),),
    "length_buckets": (8, 16, 64),
    "max_batch_size": 4,
    "max_wait_ms": 0.0,
    "dispatcher_threads": 1,  # one worker, so holding it holds every batch
}


async def hold_the_worker(
    runner: GatedRunner, client: httpx.AsyncClient
) -> asyncio.Task[httpx.Response]:
    """Start a request whose batch blocks in the model until `runner.gate` is set; return
    once that batch is in the model."""
    runner.gate.clear()
    task = asyncio.create_task(client.post("/infer", json={"inputs": "hold"}))
    started = await asyncio.to_thread(runner.started.acquire, True, 30)
    assert started, "the held request's batch never reached the model"
    return task


@dataclass
class Harness:
    client: httpx.AsyncClient
    service: Service
    runner: GatedRunner

    def runner_of(self, model: str) -> GatedRunner:
        runner = self.engine.hosts[model].batcher.runner
        assert isinstance(runner, GatedRunner)
        return runner

    @property
    def engine(self) -> EngineCore:
        engine = self.service.engine
        assert isinstance(engine, InProcessEngine)
        return engine.core

    async def hold_the_worker(self) -> asyncio.Task[httpx.Response]:
        """Start a request whose batch blocks in the model until `release()`."""
        return await hold_the_worker(self.runner, self.client)

    def release(self) -> None:
        self.runner.gate.set()

    async def queue_then_release(self, texts: list[str]) -> list[httpx.Response]:
        """While the worker is held, queue one unnormalised request per text; once all are
        queued, release the worker and return the answers in order."""
        waiting = [
            asyncio.create_task(
                self.client.post("/infer", json={"inputs": t, "parameters": {"normalize": False}})
            )
            for t in texts
        ]
        scheduler = self.engine.hosts["fake"].batcher.scheduler
        await self.until(lambda: scheduler.depth == len(texts), "all queued")
        self.release()
        return [await task for task in waiting]

    async def until(self, condition: object, what: str) -> None:
        for _ in range(10_000):
            if callable(condition) and condition():
                return
            await asyncio.sleep(0)  # yield to the loop; the condition is re-checked
        raise AssertionError(f"never happened: {what}")


@contextlib.asynccontextmanager
async def start(
    prepare: Callable[[FastAPI], None] | None = None, **overrides: object
) -> AsyncIterator[Harness]:
    """The harness, on settings `BASE` with `overrides`; `prepare` may change the app
    before it serves (its middleware is built on the first request)."""
    loader = GatedLoader()
    settings = Settings(**{**BASE, **overrides})  # type: ignore[arg-type]
    app = create_app(settings, loader=loader, tokenizer_loader=loader.tokenizer)
    if prepare is not None:
        prepare(app)
    async with serving(app) as client:
        runner = loader.runners["fake"]
        runner.started = type(runner.started)(0)  # forget warm-up's batches
        runner.batches.clear()
        yield Harness(client, app.state.service, runner)
