"""What the generation front end's tests share (tests/integration/generation_frontend/):
the prompt they send and the scripted engine behind the app, which echoes each prompt's
tokens (tests/support/scripted_generator.py)."""

from __future__ import annotations

from fastapi import FastAPI

from tests.support.scripted_generator import ScriptedGenerator

PROMPT = "The quick brown fox jumps over the lazy dog."


def engine_of(app: FastAPI) -> ScriptedGenerator:
    engine: ScriptedGenerator = app.state.test_engine
    return engine
