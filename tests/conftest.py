"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_causal_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight causal LM (`loadtest/tiny_causal_lm.py`), with a chat
    template, saved once per test session."""
    from loadtest.tiny_causal_lm import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-causal-lm"))


@pytest.fixture(scope="session")
def tiny_causal_lm_without_chat_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model and tokenizer, with no chat template."""
    from loadtest.tiny_causal_lm import build_tiny_causal_lm

    return build_tiny_causal_lm(
        tmp_path_factory.mktemp("tiny-causal-lm-plain"), chat_template=False
    )
