"""The settings the generation API tests (tests/integration/test_generation_api.py and
test_generation_disconnect.py) serve the tiny causal LM with: `tiny`, and `plain`
without a chat template, as generate models with SLOTS KV-cache slots of SLOT_TOKENS
tokens."""

from __future__ import annotations

from pathlib import Path

from app.settings import Settings
from tests.support.generation import generate_settings

SLOTS = 16
SLOT_TOKENS = 128


def settings_for(tiny: Path, plain: Path, engine: str, **overrides: object) -> Settings:
    models = {"tiny": tiny, "plain": plain}
    return generate_settings(
        models, slots=SLOTS, slot_tokens=SLOT_TOKENS, engine=engine, **overrides
    )
