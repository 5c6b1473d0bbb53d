"""A tensor model's answer is stacked off the engine's event loop when it is large: on the
loop, a 128 MiB output stalled every model's batch loop and the status publisher. The
answer's bytes are the same either way. Over a fake batcher whose rows are already
computed (no torch model, no compute thread)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from app.batch_trace import ItemResult
from app.engine.protocol import FromEngine, Output, Submit, TensorData, TensorOutput, TensorPayload
from app.engine.tensor_host import STACK_ON_LOOP_MAX_BYTES, TensorHost
from app.metrics import Metrics
from app.model_specs import TensorSpec

ROWS = 4
WIDE = (512, 1024)  # one row of it is 2 MiB of FP32


class ComputedBatcher:
    """Answers each queued row at once with its outputs (`outputs_of`)."""

    def __init__(self, outputs_of: Any) -> None:
        self.outputs_of = outputs_of
        self.scheduler = SimpleNamespace(depth=0)

    def submit(
        self, rows: Sequence[Any], deadline: float, unit: str = "tokens"
    ) -> list[asyncio.Future[ItemResult[tuple[np.ndarray, ...]]]]:
        loop = asyncio.get_running_loop()
        futures = []
        for index in range(len(rows)):
            future: asyncio.Future[ItemResult[tuple[np.ndarray, ...]]] = loop.create_future()
            future.set_result(ItemResult(self.outputs_of(index), queue_wait_s=0.0, compute_s=0.0))
            futures.append(future)
        return futures

    async def close(self) -> None:
        pass  # nothing queued, nothing running


def host_of(outputs: list[TensorSpec], outputs_of: Any) -> TensorHost:
    model = SimpleNamespace(
        name="wide",
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(-1, 2)),),
        outputs=tuple(outputs),
    )
    tracer = SimpleNamespace(arrive=lambda depth: None, finish=lambda arrival, batch: None)
    context = SimpleNamespace(metrics=Metrics(), tracer=tracer)
    return TensorHost(model, None, ComputedBatcher(outputs_of), context)  # type: ignore[arg-type]


def submit(host: TensorHost, emitted: list[FromEngine]) -> asyncio.Task[None]:
    features = np.arange(ROWS * 2, dtype=np.float32).reshape(ROWS, 2)
    payload = TensorPayload([TensorData("x", "FP32", [ROWS, 2], features.tobytes())])
    task = host.submit(Submit(1, "wide", deadline=1e9, payload=payload), emitted.append)
    assert task is not None
    return task


def outputs_of(emitted: list[FromEngine]) -> list[TensorData]:
    [output] = emitted
    assert isinstance(output, Output) and isinstance(output.payload, TensorOutput)
    return output.payload.outputs


async def answer(host: TensorHost) -> list[TensorData]:
    emitted: list[FromEngine] = []
    await submit(host, emitted)
    return outputs_of(emitted)


@pytest.fixture
def stacking_threads(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """The thread of each `np.stack` call."""
    threads: list[threading.Thread] = []
    stack = np.stack

    def recorded(arrays: Any, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread())
        return stack(arrays, *args, **kwargs)

    monkeypatch.setattr(np, "stack", recorded)
    return threads


def wide_host() -> tuple[TensorHost, list[np.ndarray], list[np.ndarray]]:
    """A host whose answer (two outputs) holds over `STACK_ON_LOOP_MAX_BYTES`."""
    rng = np.random.default_rng(7)
    wide = [rng.standard_normal(WIDE, dtype=np.float32) for _ in range(ROWS)]
    ids = [np.array([index, -index], dtype=np.int64) for index in range(ROWS)]
    assert sum(a.nbytes for a in wide) > STACK_ON_LOOP_MAX_BYTES
    host = host_of(
        [
            TensorSpec(name="scores", datatype="FP32", shape=(-1, *WIDE)),
            TensorSpec(name="ids", datatype="INT64", shape=(-1, 2)),
        ],
        lambda index: (wide[index], ids[index]),
    )
    return host, wide, ids


async def test_a_large_answer_is_stacked_off_the_event_loop_with_the_same_bytes(
    stacking_threads: list[threading.Thread],
) -> None:
    host, wide, ids = wide_host()
    outputs = await answer(host)
    await host.close()
    assert len(stacking_threads) == 2 and threading.current_thread() not in stacking_threads
    scores, stacked_ids = outputs
    assert (scores.name, scores.datatype, scores.shape) == ("scores", "FP32", [ROWS, *WIDE])
    assert scores.data == np.stack(wide).tobytes()
    assert (stacked_ids.name, stacked_ids.shape) == ("ids", [ROWS, 2])
    assert stacked_ids.data == np.stack(ids).tobytes()


async def test_a_small_answer_is_stacked_on_the_loop_without_a_thread_hop(
    stacking_threads: list[threading.Thread],
) -> None:
    host = host_of(
        [TensorSpec(name="y", datatype="FP32", shape=(-1, 3))],
        lambda index: (np.full(3, index, dtype=np.float32),),
    )
    [output] = await answer(host)
    await host.close()
    assert stacking_threads == [threading.current_thread()]
    expected = np.repeat(np.arange(ROWS, dtype=np.float32), 3).reshape(ROWS, 3)
    assert output.data == expected.tobytes() and output.shape == [ROWS, 3]


async def test_large_answers_are_stacked_on_the_host_s_one_thread_which_its_close_stops(
    stacking_threads: list[threading.Thread],
) -> None:
    """asyncio's default executor stacked them, on up to min(32, CPUs + 4) threads beyond
    the CPU budget `check-config` sizes, never stopped by the host. Now one thread of the
    host's own: `close` lets the answers still being stacked finish, then stops it."""
    host, wide, _ = wide_host()
    emitted: list[FromEngine] = []
    submit(host, emitted)
    await answer(host)  # a second answer, on the same thread
    in_flight: list[FromEngine] = []
    submit(host, in_flight)  # not started yet when the host closes
    await host.close()
    assert {thread.name for thread in stacking_threads} == {"steadyserve-stack_0"}
    assert len(set(stacking_threads)) == 1 and not stacking_threads[0].is_alive()
    for answered in (emitted, in_flight):
        assert outputs_of(answered)[0].data == np.stack(wide).tobytes()
