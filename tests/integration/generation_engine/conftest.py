"""What the engine's generation tests share: the reference model, loaded once per module."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedModel

from tests.support.generation import load_reference


@pytest.fixture(scope="module")
def reference(tiny_causal_lm: Path) -> tuple[AutoTokenizer, PreTrainedModel]:
    tokenizer, model = load_reference(tiny_causal_lm)
    return tokenizer, model
