"""Fixtures the integration tests share: `harness`, the scheduling harness on its default
settings (tests/support/scheduling.py), and `models`, the `tensor` task's test models
(tests/support/tensor_models.py), built once per module that uses them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.scheduling import Harness, start
from tests.support.tensor_models import TensorModels, build_tensor_models


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    async with start() as h:
        yield h


@pytest.fixture(scope="session")  # built once for the tensor modules (five torch.export calls)
def models(tmp_path_factory: pytest.TempPathFactory) -> TensorModels:
    return build_tensor_models(tmp_path_factory.mktemp("tensor-models"))
