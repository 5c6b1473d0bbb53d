"""Run-time health is counted per model: one model failing every batch turns the engine
unhealthy, naming it, however busy the others are. A real `EngineCore` over two stand-in
models (`tests/support/fake_model.py`), warm-up off; the unit tests of the count itself are
in `test_engine_pure.py`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import torch

from app.engine.core import EngineCore
from app.engine.protocol import EmbedPayload, Failure, FailureKind, FromEngine, Output, Submit
from app.metrics import Metrics
from tests.support.fake_model import GatedLoader
from tests.support.stand_in_engine import final_answer, stand_in_settings

THRESHOLD = 2
SETTINGS = stand_in_settings("a", "b", unhealthy_after_failed_batches=THRESHOLD)


@pytest.fixture
async def loaded() -> AsyncIterator[tuple[EngineCore, GatedLoader]]:
    loader = GatedLoader()
    core = EngineCore(SETTINGS, Metrics(), loader=loader)
    await core.start()
    assert core.ready
    try:
        yield core, loader
    finally:
        await core.stop()


async def answer(core: EngineCore, request_id: int, model: str) -> FromEngine:
    """The final answer of one input sent to `model`."""
    request = Submit(request_id, model, time.monotonic() + 30, EmbedPayload([[1, 5, 2]]))
    return await final_answer(core, request)


async def test_a_model_failing_every_batch_is_unhealthy_while_another_serves(
    loaded: tuple[EngineCore, GatedLoader],
) -> None:
    """Every batch of b reset the engine's one count between a's failures: a answered 500
    for ever while /healthz (`healthy`) and /readyz stayed 200."""
    core, loader = loaded
    loader.runners["a"].failure = torch.OutOfMemoryError("fake: a's buffers")
    for request_id in range(0, 2 * THRESHOLD, 2):
        failed = await answer(core, request_id, "a")
        assert isinstance(failed, Failure) and failed.kind is FailureKind.FAILED
        served = await answer(core, request_id + 1, "b")
        assert isinstance(served, Output)
    status = core.status()
    assert not status.healthy
    assert status.problem == "model 'a': 2 consecutive batches failed (OutOfMemoryError)"
    loader.runners["a"].failure = None
    assert isinstance(await answer(core, 100, "a"), Output)  # a's own success clears it
    assert core.status().healthy and core.status().problem is None
