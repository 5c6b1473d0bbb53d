"""Fixtures the integration tests share: `harness`, the scheduling harness on its default
settings (tests/support/scheduling.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.scheduling import Harness, start


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    async with start() as h:
        yield h
