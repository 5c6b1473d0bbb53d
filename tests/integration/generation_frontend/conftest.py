"""What the generation front end's tests share: settings with two generate models (one
without a chat template) and an embedding model, and, once per module, the app in front
of a scripted engine with a client on it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI

from app.main import create_app
from app.model_specs import ModelSpec
from app.settings import Settings
from tests.support.asgi import serving
from tests.support.scripted_generator import ScriptedGenerator


@pytest.fixture(scope="module")
def settings(tiny_causal_lm: Path, tiny_causal_lm_without_chat_template: Path) -> Settings:
    return Settings(
        engine="inprocess",
        models=(
            ModelSpec(name="tiny", task="generate", source=str(tiny_causal_lm)),
            ModelSpec(
                name="plain", task="generate", source=str(tiny_causal_lm_without_chat_template)
            ),
            ModelSpec(name="minilm"),
        ),
        max_queue_delay_ms=10_000,
        spike_reports=False,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(settings: Settings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app in front of a scripted engine (`engine_of`), started and ready, and a client
    on it: a test asking for the app alone gets it started too, whatever ran before."""
    engine = ScriptedGenerator(settings)
    application = create_app(settings, engine=engine)
    application.state.test_engine = engine
    async with serving(application) as client:
        yield application, client


@pytest.fixture(scope="module")
def app(served: tuple[FastAPI, httpx.AsyncClient]) -> FastAPI:
    return served[0]


@pytest.fixture(scope="module")
def client(served: tuple[FastAPI, httpx.AsyncClient]) -> httpx.AsyncClient:
    return served[1]
