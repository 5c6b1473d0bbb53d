"""Fixtures the integration tests share: `harness`, the scheduling harness on its default
settings (tests/support/scheduling.py); `models`, the `tensor` task's test models
(tests/support/tensor_models.py), built once per module that uses them; and `client`, an
HTTP client of the server a module serves at its own `base_url` fixture."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

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
