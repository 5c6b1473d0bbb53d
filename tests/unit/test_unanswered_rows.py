"""A request whose rows all computed is still answered when making its answer fails
(`engine/rows.py::answer_rows`): a `MemoryError` stacking a large answer, or the tracer
raising, killed the host's answering task unanswered ("Task exception was never retrieved"
was all the log said), and its front end waited out the deadline and `ANSWER_GRACE_S`, then
said 503 `not_ready`. Now it is the server's fault: 500 (`FAILED`), its traceback logged.
Real hosts over a batcher whose rows are already computed (no torch model)."""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from app.engine.client import failure_error
from app.engine.embedding_host import EmbeddingHost
from app.engine.protocol import EmbedPayload, Failure, FailureKind, FromEngine, Submit
from app.failures import BatchFailed
from app.metrics import Metrics
from tests.unit.test_tensor_outputs import ComputedBatcher, submit, wide_host


def assert_answered_500(emitted: list[FromEngine], cause: str, caplog: Any) -> None:
    [failure] = emitted
    assert isinstance(failure, Failure) and failure.kind is FailureKind.FAILED
    assert cause in failure.message and f"request {failure.request_id}" in failure.message
    assert isinstance(failure_error(failure), BatchFailed)  # the front end's 500
    [record] = [r for r in caplog.records if "answer could not be made" in r.getMessage()]
    assert record.levelno == logging.ERROR and record.exc_info is not None


async def test_a_large_answer_that_cannot_be_stacked_is_answered_500(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    host, _, _ = wide_host()
    stack = np.stack

    def out_of_memory(arrays: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():  # the stacking thread
            raise MemoryError("Unable to allocate 512 MiB")
        return stack(arrays, *args, **kwargs)

    monkeypatch.setattr(np, "stack", out_of_memory)
    emitted: list[FromEngine] = []
    task = submit(host, emitted)
    await asyncio.wait({task})
    await host.close()
    assert task.exception() is None
    assert_answered_500(emitted, "MemoryError", caplog)


async def test_an_embedding_answer_the_tracer_fails_on_is_answered_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    batcher = ComputedBatcher(lambda index: np.full(4, index, dtype=np.float32))
    batcher.runner = SimpleNamespace(name="e")  # type: ignore[attr-defined]
    batcher.pool = None  # type: ignore[attr-defined]

    def finish(arrival: object, batch: object) -> None:
        raise RuntimeError("the tracer's probes are gone")

    tracer = SimpleNamespace(arrive=lambda depth: None, finish=finish)
    context = SimpleNamespace(metrics=Metrics(), tracer=tracer)
    host = EmbeddingHost(batcher, context)  # type: ignore[arg-type]
    emitted: list[FromEngine] = []
    request = Submit(7, "e", deadline=1e9, payload=EmbedPayload([[1, 2], [3]]))
    task = host.submit(request, emitted.append)
    assert task is not None
    await asyncio.wait({task})
    assert task.exception() is None
    assert_answered_500(emitted, "RuntimeError", caplog)
