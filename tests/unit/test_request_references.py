"""A request is named by its reference, its number at the identity of the front end that
sent it (`identity.request_reference`: `41@fe-4242-3`), in the engine's log and in the
answer that points there. Each front end numbers its requests from 1 (again after a
restart), and the log said "request 41" for every front end's 41st: the README's "the
request number the answer gives" named several requests. A real `EngineCore` over the
stand-in model (`tests/support/fake_model.py`), which throws on one input."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import pytest
import torch

from app.engine.client import EngineUnavailable, StreamingClient
from app.engine.core import EngineCore
from app.engine.protocol import (
    EmbedPayload,
    EngineStatus,
    Failure,
    FailureKind,
    FromEngine,
    Submit,
    ToEngine,
)
from app.metrics import Metrics
from tests.support.engine_status import ready_status
from tests.support.fake_model import GatedLoader
from tests.support.stand_in_engine import final_answer, stand_in_settings

POISON = 9  # the stand-in model throws on an input holding this token
SETTINGS = stand_in_settings("a")


@pytest.fixture
async def core() -> AsyncIterator[EngineCore]:
    loader = GatedLoader()
    core = EngineCore(SETTINGS, Metrics(), loader=loader)
    await core.start()
    runner = loader.runners["a"]
    forward = runner.forward

    def throws_on_poison(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if bool((input_ids == POISON).any()):
            raise IndexError("index out of range in self")
        return forward(input_ids, attention_mask)

    runner.forward = throws_on_poison  # type: ignore[method-assign]
    try:
        yield core
    finally:
        await core.stop()


async def answer(core: EngineCore, origin: bytes, request_id: int) -> FromEngine:
    """The answer to a request of a good input and a poison one, sent by `origin`."""
    request = Submit(request_id, "a", time.monotonic() + 30, EmbedPayload([[1, 5], [1, POISON]]))
    return await final_answer(core, request, origin)


async def test_an_input_the_model_fails_on_is_logged_and_answered_under_its_reference(
    core: EngineCore, caplog: pytest.LogCaptureFixture
) -> None:
    """Two front ends' request 41, each failing on its input 1: each answer names its own
    request, and the log line each points at is that request's alone."""
    answers = {}
    with caplog.at_level(logging.WARNING, logger="app.engine.rows"):
        for origin in (b"fe-4242-3", b"fe-4343-5"):
            answers[origin] = await answer(core, origin, 41)
    for origin, reference in ((b"fe-4242-3", "41@fe-4242-3"), (b"fe-4343-5", "41@fe-4343-5")):
        failure = answers[origin]
        assert isinstance(failure, Failure) and failure.kind is FailureKind.BAD_REQUEST
        assert failure.message == (
            "the model could not process input 1 (IndexError); "
            f"the server logged why under request {reference}"
        )
        [logged] = [r for r in caplog.records if f"request {reference} " in r.getMessage()]
        assert logged.getMessage() == f"request {reference} to a: the model failed on input 1 of it"


class Silent(StreamingClient):
    """A front end whose engine never answers."""

    def status(self) -> EngineStatus | None:
        return ready_status("e", time.monotonic())

    def _send(self, message: ToEngine) -> None:
        pass


async def test_a_request_the_engine_never_answered_is_logged_under_its_reference(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = Silent(origin=b"fe-4242-3")
    client.answer_grace_s = 0.01
    request = Submit(client.next_request_id(), "a", time.monotonic(), EmbedPayload([[1]]))
    with pytest.raises(EngineUnavailable):
        async for _ in client.stream(request):
            pass
    [logged] = [r for r in caplog.records if r.name == "app.engine.client"]
    assert logged.getMessage() == "the engine never answered request 1@fe-4242-3; giving up"
