"""A batch that fails with a sticky CUDA error (a poison input: an index past a tensor model's
embedding table asserts on the device) has its requests answered 500 `device_lost` (not to be
resent unchanged) before the engine exits for a fresh one. The exit ran inside the call that
recorded the failure, before the answers' tasks ran: every request, the poison one included,
was answered the retryable 503 `engine_lost` by its front end, and a client resending it took
each fresh engine down again. A batch that failed of the device another batch lost is
answered 503 `engine_lost` (retry), as the exit leaves the others. Fake errors for which
`failures.device_lost` holds; no CUDA."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import zmq
from fastapi import FastAPI

from app.admission import Rejected, RejectReason
from app.api.errors import install_error_handlers
from app.batch_trace import ItemResult
from app.compute_slots import ComputeSlots
from app.engine.client import failure_error
from app.engine.health import BatchHealth
from app.engine.lost_device import step_failure
from app.engine.process import DEVICE_LOST_EXIT, EngineServer, exit_when_device_lost
from app.engine.protocol import (
    EmbedPayload,
    Failure,
    FailureKind,
    FromEngine,
    Submit,
    decode_batch_from_engine,
)
from app.engine.rows import gather_rows
from app.engine.zmq_client import EngineAddresses
from app.failures import (
    DEVICE_LOST,
    DEVICE_LOST_MESSAGE,
    RETRY_AFTER_ENGINE_LOST_S,
    DeviceLost,
    device_lost,
)
from app.metrics import Metrics
from app.scheduler import BatchPolicy, BatchShape
from tests.support.inline_batching import Computed, inline_batcher

POISON = 5  # the row the fake model's batch fails on with a sticky CUDA error
POLICY = BatchPolicy(length_buckets=(8,), max_batch_size=4, max_batch_tokens=64, max_wait_s=0)


def assert_error() -> RuntimeError:
    """A device-side assert, as torch raises it (a plain RuntimeError in older torch)."""
    return RuntimeError("CUDA error: device-side assert triggered")


class PoisonModel:
    """Doubles rows; a batch holding POISON fails with a sticky CUDA error."""

    def __init__(self) -> None:
        self.errors: list[RuntimeError] = []

    def __call__(self, shape: BatchShape, rows: Sequence[int]) -> Computed:
        if POISON in rows:
            self.errors.append(assert_error())
            raise self.errors[-1]
        return Computed(rows)


def answer(
    futures: list[asyncio.Future[ItemResult[int]]], request_id: int, emitted: list[FromEngine]
) -> asyncio.Task[object]:
    """The request's answer, as the engine's batched hosts make it (`gather_rows`)."""
    request = Submit(request_id, "m", deadline=1e9, payload=EmbedPayload([[1]]))
    return asyncio.create_task(gather_rows(futures, request, emitted.append, Metrics()))


async def until(condition: Callable[[], object], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    ends = loop.time() + timeout_s
    while not condition():
        assert loop.time() < ends, "timed out"
        await asyncio.sleep(0.005)


async def test_the_batch_that_lost_the_device_is_answered_device_lost_before_the_exit() -> None:
    """Its two requests (the poison one and another of the same batch) were never answered
    by the engine: it exited within the batch's own failure handling."""
    health = BatchHealth(threshold=5)
    emitted: list[FromEngine] = []
    exits: list[tuple[int, list[FromEngine]]] = []  # each exit, and what was answered by then
    exit_when_device_lost(health, exit_process=lambda code: exits.append((code, list(emitted))))
    batcher = inline_batcher(PoisonModel(), ComputeSlots(1), POLICY, on_batch_done=health.record)
    poison = answer(batcher.submit([POISON], deadline=100.0), 1, emitted)
    beside = answer(batcher.submit([1], deadline=100.0), 2, emitted)
    batcher.start()
    await until(lambda: exits)
    await asyncio.gather(poison, beside)
    await batcher.close()
    [(code, answered)] = exits
    assert code == DEVICE_LOST_EXIT and health.lost_device
    assert sorted(answered, key=lambda m: m.request_id) == [
        Failure(1, FailureKind.FAILED, DEVICE_LOST_MESSAGE, reason=DEVICE_LOST),
        Failure(2, FailureKind.FAILED, DEVICE_LOST_MESSAGE, reason=DEVICE_LOST),
    ]
    error = failure_error(answered[0])  # type: ignore[arg-type]
    assert isinstance(error, DeviceLost)  # the front end's 500 `device_lost`


async def test_a_batch_failing_of_a_device_another_batch_lost_is_answered_engine_lost() -> None:
    """Its requests did not cause the loss: retryable, as the exit leaves every other one."""
    health = BatchHealth(threshold=5)
    health.record(assert_error(), "other-model")  # another batch lost the device first
    emitted: list[FromEngine] = []
    batcher = inline_batcher(
        PoisonModel(),
        ComputeSlots(1),
        POLICY,
        on_batch_done=health.record,
        lost_device_before=health.lost_device_before,
    )
    done = answer(batcher.submit([POISON], deadline=100.0), 3, emitted)
    batcher.start()
    await done
    await batcher.close()
    [failure] = emitted
    assert isinstance(failure, Failure) and failure.kind is FailureKind.REJECTED
    assert failure.reason == RejectReason.ENGINE_LOST.value
    assert failure.retry_after_s == RETRY_AFTER_ENGINE_LOST_S
    error = failure_error(failure)
    assert isinstance(error, Rejected) and error.reason is RejectReason.ENGINE_LOST


def test_health_tells_the_failure_that_lost_the_device_from_those_after_it() -> None:
    health = BatchHealth(threshold=5)
    first, later = assert_error(), assert_error()
    assert not health.lost_device_before(first)  # asked before it is recorded
    health.record(first, "m")
    assert not health.lost_device_before(first) and health.lost_device_before(later)


def test_a_generation_step_that_lost_the_device_answers_its_sequences_device_lost() -> None:
    request = Submit(4, "gen", deadline=1e9, payload=EmbedPayload([[1]]))
    error = assert_error()
    assert device_lost(error)
    alone = SimpleNamespace(lost_device_before=lambda failed: False)
    lost = step_failure(request, error, alone)  # type: ignore[arg-type]
    assert lost == Failure(4, FailureKind.FAILED, DEVICE_LOST_MESSAGE, reason=DEVICE_LOST)
    after = SimpleNamespace(lost_device_before=lambda failed: True)
    beside = step_failure(request, error, after)  # type: ignore[arg-type]
    assert beside.kind is FailureKind.REJECTED and beside.reason == "engine_lost"
    other = step_failure(request, ValueError("boom"), alone)  # type: ignore[arg-type]
    assert other.kind is FailureKind.FAILED and other.reason is None


class LostCore:
    """The engine server's core where only its health is read."""

    def __init__(self) -> None:
        self.health = BatchHealth(threshold=5)


async def test_what_was_answered_reaches_the_front_end_before_the_engine_exits(
    tmp_path: Path,
) -> None:
    """The answer emitted as the device was lost is sent, and has left the socket, when the
    process exits (ZeroMQ's I/O thread would drop what it still held)."""
    addresses = EngineAddresses.in_directory(tmp_path)
    front_end = zmq.Context()
    dealer = front_end.socket(zmq.DEALER)
    arrived: list[int] = []

    def exit_process(code: int) -> None:
        arrived.append(dealer.poll(2000, zmq.POLLIN))  # what had reached the front end

    core = LostCore()
    server = EngineServer(core, addresses, exit_process=exit_process)  # type: ignore[arg-type]
    try:
        dealer.connect(addresses.requests)
        dealer.send(b"hello")  # the router learns the front end's identity
        origin, _ = await asyncio.wait_for(server._router.recv_multipart(), 10)
        failure = Failure(9, FailureKind.FAILED, DEVICE_LOST_MESSAGE, reason=DEVICE_LOST)
        server._emitter(origin)(failure)
        core.health.record(assert_error(), "m")
        assert not arrived  # not in the call that recorded the loss
        await until(lambda: arrived)
        assert arrived[0]
        assert decode_batch_from_engine(dealer.recv()) == [failure]
    finally:
        dealer.close(linger=0)
        front_end.term()
        server._context.destroy(linger=0)


async def test_the_front_end_answers_device_lost_500_without_retry_after() -> None:
    app = FastAPI()
    install_error_handlers(app)
    failure = Failure(1, FailureKind.FAILED, DEVICE_LOST_MESSAGE, reason=DEVICE_LOST)

    @app.post("/infer")
    async def infer() -> None:
        raise failure_error(failure)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        response = await client.post("http://test/infer")
    assert response.status_code == 500 and "retry-after" not in response.headers
    assert response.json()["error"]["type"] == "device_lost"
    assert response.json()["error"]["message"] == DEVICE_LOST_MESSAGE


@pytest.mark.parametrize("first", [True, False])
def test_a_device_lost_failure_says_which(first: bool) -> None:
    assert ("retry" in str(DeviceLost(first=first))) is not first
