"""A batched host's `close` (the engine's `stop`: "finish what is queued and running") returns
only once the answers of the batches it finished are sent. Each request is answered by a task
of its own, which runs only after its rows' batch is done: `EmbeddingHost.close` returned as
soon as its batcher had closed, while those tasks were still pending, and the engine stopped
with them unsent (`TensorHost` waited for its own; both now share the code,
`engine/rows.py::BatchedHost`). Real hosts over a batcher whose queued rows are computed when
it closes (no torch model)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from app.batch_trace import ItemResult
from app.engine.embedding_host import EmbeddingHost
from app.engine.protocol import EmbedOutput, EmbedPayload, FromEngine, Output, Submit, TensorOutput
from app.engine.rows import BatchedHost
from app.metrics import Metrics
from app.model_specs import TensorSpec
from tests.unit.test_tensor_outputs import host_of, submit
from tests.unit.test_tensor_outputs import outputs_of as tensor_outputs


class QueuedBatcher:
    """Keeps every row queued until it closes, then computes them all (`outputs_of`), as a
    batcher's `close` runs what is queued before it returns."""

    def __init__(self, outputs_of: Callable[[int], Any]) -> None:
        self.outputs_of = outputs_of
        self.scheduler = SimpleNamespace(depth=0)
        self.runner = SimpleNamespace(name="e")
        self.pool = None
        self._queued: list[tuple[asyncio.Future[ItemResult[Any]], int]] = []

    def submit(
        self, rows: Sequence[Any], deadline: float, unit: str = "tokens"
    ) -> list[asyncio.Future[ItemResult[Any]]]:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[ItemResult[Any]]] = []
        for index in range(len(rows)):
            futures.append(loop.create_future())
            self._queued.append((futures[-1], index))
        return futures

    async def close(self) -> None:
        for future, index in self._queued:
            future.set_result(ItemResult(self.outputs_of(index), queue_wait_s=0.0, compute_s=0.0))
        self._queued.clear()


Check = Callable[[list[FromEngine]], None]  # sends a request, or checks it was answered
Made = tuple[BatchedHost, Check, Check]


def context() -> SimpleNamespace:
    tracer = SimpleNamespace(arrive=lambda depth: None, finish=lambda arrival, batch: None)
    return SimpleNamespace(metrics=Metrics(), tracer=tracer)


def embedding_host() -> Made:
    batcher = QueuedBatcher(lambda index: np.full(4, index, dtype=np.float32))
    host = EmbeddingHost(batcher, context())  # type: ignore[arg-type]

    def send(emitted: list[FromEngine]) -> None:
        request = Submit(7, "e", deadline=1e9, payload=EmbedPayload([[1, 2], [3]]))
        assert host.submit(request, emitted.append) is not None

    def answered(emitted: list[FromEngine]) -> None:
        [output] = emitted
        assert isinstance(output, Output) and isinstance(output.payload, EmbedOutput)
        assert output.final and output.payload.rows == 2

    return host, send, answered


def tensor_host() -> Made:
    spec = TensorSpec(name="y", datatype="FP32", shape=(-1, 3))
    host = host_of([spec], lambda index: (np.full(3, index, dtype=np.float32),))
    host.batcher = QueuedBatcher(host.batcher.outputs_of)  # type: ignore[attr-defined]

    def send(emitted: list[FromEngine]) -> None:
        submit(host, emitted)

    def answered(emitted: list[FromEngine]) -> None:
        assert isinstance(emitted[0], Output) and isinstance(emitted[0].payload, TensorOutput)
        assert tensor_outputs(emitted)[0].shape == [4, 3]

    return host, send, answered


@pytest.mark.parametrize("make", [embedding_host, tensor_host], ids=["embed", "tensor"])
async def test_close_returns_only_once_the_answers_of_what_it_finished_are_sent(
    make: Callable[[], Made],
) -> None:
    host, send, answered = make()
    emitted: list[FromEngine] = []
    send(emitted)
    await asyncio.sleep(0)  # its answering task runs, and waits for its rows
    assert emitted == []
    await host.close()
    answered(emitted)
    assert host._answers == set()
