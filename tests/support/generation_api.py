"""The settings the generation API tests (tests/integration/test_generation_api.py and
test_generation_disconnect.py) serve the tiny causal LM with: `tiny`, and `plain`
without a chat template, as generate models with SLOTS KV-cache slots of SLOT_TOKENS
tokens; and `served`, the app over them in each of `ENGINE_MODES`, for the tests that
compare the server's answers with a reference forward in both."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from app.main import create_app
from app.settings import Settings
from tests.support.generation import generate_settings
from tests.support.listening import listening

SLOTS = 16
SLOT_TOKENS = 128


def settings_for(tiny: Path, plain: Path, engine: str, **overrides: object) -> Settings:
    models = {"tiny": tiny, "plain": plain}
    return generate_settings(
        models, slots=SLOTS, slot_tokens=SLOT_TOKENS, engine=engine, **overrides
    )


# The engine in its own process, one step a dispatch; and in the front end's process, four
# steps a dispatch (multi-step decoding).
ENGINE_MODES = [("process", 1), ("inprocess", 4)]
IN_PROCESS = ("inprocess", 1)  # the tests of the front end's work: the engine in process


@asynccontextmanager
async def served(mode: tuple[str, int], tiny: Path, plain: Path) -> AsyncIterator[str]:
    """The app over `tiny` and `plain` in `mode` (one of `ENGINE_MODES`), listening: its URL."""
    engine, steps = mode
    settings = settings_for(tiny, plain, engine, generate_steps_per_dispatch=steps)
    async with listening(create_app(settings)) as url:
        yield url
