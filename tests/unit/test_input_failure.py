"""A request with an input the model fails on (run alone after its batch failed) is answered
400 naming that input and the class of what the model raised, never the exception's text
(it may hold anything: the input itself, tensor contents, the model's internals); the whole
of it, traceback included, is in the engine's log under the request's id."""

from __future__ import annotations

import asyncio
import logging

import pytest

from app.batch_trace import ItemResult
from app.engine.protocol import EmbedPayload, Failure, FailureKind, FromEngine, Submit
from app.engine.rows import gather_rows
from app.failures import InputFailed
from app.metrics import Metrics

SECRET = "row 1 of the user's private text"


def failed_as_the_batcher_fails_it() -> InputFailed:
    """An `InputFailed` as `Batcher` sets it: the model's own exception as its cause."""
    try:
        raise IndexError(f"index 30522 is out of range: {SECRET}")
    except IndexError as model_error:
        failure = InputFailed(repr(model_error))
        failure.__cause__ = model_error
        return failure


async def test_the_400_names_the_input_and_the_log_holds_what_the_model_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[ItemResult[int]]] = [loop.create_future() for _ in range(3)]
    futures[0].set_result(ItemResult(value=1, queue_wait_s=0.0, compute_s=0.0))
    futures[1].set_exception(failed_as_the_batcher_fails_it())
    answers: list[FromEngine] = []
    request = Submit(41, "minilm", 1e12, EmbedPayload([[1], [2], [3]]))
    with caplog.at_level(logging.WARNING, logger="app.engine.rows"):
        assert await gather_rows(futures, request, answers.append, Metrics()) is None
    [failure] = answers
    assert isinstance(failure, Failure) and failure.kind is FailureKind.BAD_REQUEST
    assert SECRET not in failure.message and "30522" not in failure.message, failure.message
    assert "input 1" in failure.message and "(IndexError)" in failure.message
    assert failure.input_index == 1
    assert "request 41" in failure.message  # what to look the log up by
    [record] = caplog.records
    logged = record.getMessage() + "\n" + caplog.text
    assert "request 41" in logged and "minilm" in logged and "input 1" in logged
    assert SECRET in caplog.text and "Traceback" in caplog.text  # the model's own, whole
    assert futures[2].cancelled()  # the rest of the request is not computed for nobody
