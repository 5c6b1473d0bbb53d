"""The engine process stops (and its supervisor starts a fresh one) when its request or
status loop ends on its own: it would otherwise take no request, or publish no status,
while running; and it publishes a status only when it changed, or as a heartbeat."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from app.engine.health import BatchHealth
from app.engine.process import (
    DEVICE_LOST_EXIT,
    TASK_ENDED_EXIT,
    EngineServer,
    exit_when_device_lost,
    worth_publishing,
)
from app.engine.protocol import (
    EngineStatus,
    Failure,
    FailureKind,
    decode_batch_from_engine,
    request_to_answer,
)
from app.engine.zmq_client import STATUS_HEARTBEAT_S, EngineAddresses
from tests.support.engine_status import ready_status


async def test_a_loop_that_ends_on_its_own_stops_the_engine() -> None:
    async def broken() -> None:
        raise ValueError("a bug in the loop")

    stop = asyncio.Event()
    task = asyncio.create_task(broken(), name="engine-requests")
    task.add_done_callback(lambda done: EngineServer._on_task_end(done, stop))
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)  # done callbacks run on the loop's next turn
    assert stop.is_set()


class StoppingCore:
    """The engine server's core where nothing reaches it, started and stopped at once."""

    def __init__(self) -> None:
        self.health = BatchHealth(threshold=5)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


async def test_a_loop_that_ends_on_its_own_is_logged_with_its_traceback_and_exits_non_zero(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its exception was logged as a `repr` alone (no stack) and the engine exited 0: the
    supervisor said "engine N exited with code 0", a clean exit by its words."""
    server = EngineServer(StoppingCore(), EngineAddresses.in_directory(tmp_path))  # type: ignore[arg-type]

    async def broken() -> None:
        raise ValueError("a bug in the loop")

    server._publish = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.CRITICAL, logger="app.engine.process"):
        status = await asyncio.wait_for(server.serve(asyncio.Event()), 10)
    assert status == TASK_ENDED_EXIT != 0
    [record] = [r for r in caplog.records if r.name == "app.engine.process"]
    assert record.getMessage() == "engine: engine-status ended; stopping the engine"
    assert record.exc_info is not None and isinstance(record.exc_info[1], ValueError)
    from app.engine.supervisor import loss_reason

    assert loss_reason(7, TASK_ENDED_EXIT, None) == (
        "engine 7 exited with code 4 (a loop of its own ended: see its log)"
    )


def test_the_engine_process_exits_with_the_status_serving_ended_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.engine import process
    from app.settings import Settings

    async def ended(*args: object) -> tuple[int, bool]:
        return TASK_ENDED_EXIT, False

    monkeypatch.setattr(process, "die_with_parent", lambda pid: None)
    monkeypatch.setattr(process, "_serve", ended)
    addresses = EngineAddresses.in_directory(tmp_path)
    with pytest.raises(SystemExit) as exited:
        process.run_engine_process(Settings(), addresses, parent_pid=1)
    assert exited.value.code == TASK_ENDED_EXIT


async def test_an_engine_asked_to_stop_exits_0(tmp_path: Path) -> None:
    server = EngineServer(StoppingCore(), EngineAddresses.in_directory(tmp_path))  # type: ignore[arg-type]

    async def quiet() -> None:
        await asyncio.Event().wait()

    server._publish = quiet  # type: ignore[method-assign]
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    assert await asyncio.wait_for(server.serve(stop), 10) == 0


async def test_a_loop_cancelled_at_shutdown_is_not_a_failure() -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(asyncio.Event().wait(), name="engine-status")
    task.add_done_callback(lambda done: EngineServer._on_task_end(done, stop))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert not stop.is_set()


def _status(published_at: float, **changes: object) -> EngineStatus:
    fields: dict[str, Any] = {"engine_id": "e1", "taken_inputs": {b"frontend-a": 3}, **changes}
    return ready_status(published_at=published_at, **fields)


def test_a_status_that_changed_only_in_time_is_not_sent_again_until_the_heartbeat() -> None:
    sent = _status(10.0)
    assert worth_publishing(sent, None)
    assert not worth_publishing(_status(10.0 + STATUS_HEARTBEAT_S / 2), sent)
    assert worth_publishing(_status(10.0 + STATUS_HEARTBEAT_S * 1.01), sent)


def test_any_other_change_is_sent_at_once() -> None:
    sent = _status(10.0)
    soon = 10.0 + STATUS_HEARTBEAT_S / 10
    assert worth_publishing(_status(soon, backlog_s=0.004), sent)
    assert worth_publishing(_status(soon, taken_inputs={b"frontend-a": 4}), sent)
    assert worth_publishing(_status(soon, state="failed", problem="CUDA error"), sent)
    assert worth_publishing(_status(soon, engine_id="e2"), sent)


def test_the_engine_process_exits_when_its_device_is_lost() -> None:
    """A device-side assert left the engine running with a dead CUDA context; it exits now,
    so that its supervisor starts a fresh engine (a fresh context)."""
    import torch  # torch's own exception class, as CUDA raises it (built here on the CPU)

    health = BatchHealth(threshold=5)
    exits: list[int] = []
    exit_when_device_lost(health, exit_process=exits.append)
    health.record(RuntimeError("the device fell over"))
    assert exits == []
    health.record(torch.AcceleratorError("CUDA error: device-side assert triggered"))
    assert exits == [DEVICE_LOST_EXIT]


def submit_of_another_version(request_id: object) -> bytes:
    """A Submit whose payload this engine does not know (a front end of another version)."""
    payload = {"type": "video", "frames": []}
    message = {"type": "submit", "request_id": request_id, "model": "m", "deadline": 1e12}
    return msgspec.msgpack.encode({**message, "payload": payload, "priority": 3})


class NoCore:
    """The engine server's core where nothing reaches it (every message here is unreadable)."""

    def __init__(self) -> None:
        self.health = BatchHealth(threshold=5)


async def test_an_unreadable_request_is_answered_with_a_failure(tmp_path: Path) -> None:
    """A message that did not decode had no id to answer: its request got nothing, and its
    client waited out the deadline and the front end's grace (a 503 seconds later)."""
    addresses = EngineAddresses.in_directory(tmp_path)
    server = EngineServer(NoCore(), addresses)  # type: ignore[arg-type]
    intake = asyncio.create_task(server._receive())
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(addresses.requests)
    try:
        await dealer.send(submit_of_another_version(7))
        [failure] = decode_batch_from_engine(await asyncio.wait_for(dealer.recv(), 10))
        assert isinstance(failure, Failure) and failure.request_id == 7
        assert failure.kind is FailureKind.FAILED and "could not be read" in failure.message
        assert not intake.done()
    finally:
        intake.cancel()
        await asyncio.gather(intake, return_exceptions=True)
        context.destroy(linger=0)
        server._context.destroy(linger=0)


@pytest.mark.parametrize(
    "unreadable",
    [
        b"not a protocol message",
        submit_of_another_version("seven"),  # no id to answer: logged and dropped
        msgspec.msgpack.encode({"type": "cancel", "request_id": "7"}),
        msgspec.msgpack.encode({"type": "frontend_gone", "pid": "12"}),
    ],
)
def test_an_unreadable_message_without_a_request_to_answer_is_dropped(unreadable: bytes) -> None:
    assert request_to_answer(unreadable) is None
