"""Fixtures the integration tests share: `harness`, the scheduling harness on its default
settings (tests/support/scheduling.py); `models`, the `tensor` task's test models
(tests/support/tensor_models.py), built once per module that uses them; `client`, an
HTTP client of the server a module serves at its own `base_url` fixture; and `reference`,
the tiny causal LM's tokenizer and model as transformers loads them, once per module (a
module serving another model overrides it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from transformers import AutoTokenizer, PreTrainedModel

from tests.support.generation import load_reference
from tests.support.scheduling import Harness, start
from tests.support.tensor_models import TensorModels, build_tensor_models


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    async with start() as h:
        yield h


@pytest.fixture(scope="session")  # built once for the tensor modules (five torch.export calls)
def models(tmp_path_factory: pytest.TempPathFactory) -> TensorModels:
    return build_tensor_models(tmp_path_factory.mktemp("tensor-models"))


@pytest_asyncio.fixture(loop_scope="module")
async def client(base_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(tiny_causal_lm: Path) -> tuple[AutoTokenizer, PreTrainedModel]:
    tokenizer, model = load_reference(tiny_causal_lm)
    return tokenizer, model
