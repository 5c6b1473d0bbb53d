"""The engine process's intake survives a message that fails: it is answered with a failure,
and the requests after it are still served (a dead intake loop left every later request
unanswered while the status still said ready). Real ZeroMQ sockets, a scripted core."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from app.engine.health import BatchHealth
from app.engine.host import Emit
from app.engine.process import EngineServer
from app.engine.protocol import (
    EmbedOutput,
    EmbedPayload,
    Failure,
    FailureKind,
    FromEngine,
    Output,
    Submit,
    decode_batch_from_engine,
    encode,
)
from app.engine.zmq_client import EngineAddresses


class ScriptedCore:
    """Answers a request of one input; raises on any other (a bug in the engine)."""

    def __init__(self) -> None:
        self.health = BatchHealth(threshold=5)  # the server exits on a lost device through it

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def submit(self, origin: bytes, request: Submit, emit: Emit) -> None:
        assert isinstance(request.payload, EmbedPayload)
        if len(request.payload.token_ids) != 1:
            raise RuntimeError("a bug in the engine")
        emit(Output(request.request_id, True, EmbedOutput(b"", 0, 0, 1), 0.0, 0.0))

    def cancel(self, origin: bytes, request_id: int) -> None:
        pass

    def status(self) -> Any:
        raise NotImplementedError  # the status publisher is not started here


async def answer(dealer: zmq.asyncio.Socket, intake: asyncio.Task[None]) -> list[FromEngine]:
    """The engine's next frame to this front end; fails if the intake loop ends first."""
    receiving = asyncio.ensure_future(dealer.recv())
    done, _ = await asyncio.wait({receiving, intake}, return_when=asyncio.FIRST_COMPLETED)
    if receiving not in done:
        receiving.cancel()
        raise AssertionError(f"the intake loop ended: {intake.exception()!r}")
    return decode_batch_from_engine(receiving.result())


async def test_a_failing_message_is_answered_and_the_next_is_served(tmp_path: Path) -> None:
    addresses = EngineAddresses.in_directory(tmp_path)
    server = EngineServer(ScriptedCore(), addresses)  # type: ignore[arg-type]
    intake = asyncio.create_task(server._receive())
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(addresses.requests)
    try:
        await dealer.send(encode(Submit(1, "m", 1e12, EmbedPayload([[1], [2]]))))
        [failure] = await answer(dealer, intake)
        assert isinstance(failure, Failure) and failure.request_id == 1
        assert failure.kind is FailureKind.FAILED and "a bug in the engine" in failure.message
        await dealer.send(b"not a protocol message")  # logged; it has no id to answer
        await dealer.send(encode(Submit(2, "m", 1e12, EmbedPayload([[1]]))))
        [served] = await answer(dealer, intake)
        assert isinstance(served, Output) and served.request_id == 2 and served.final
        assert not intake.done()
    finally:
        intake.cancel()
        await asyncio.gather(intake, return_exceptions=True)
        context.destroy(linger=0)
        server._context.destroy(linger=0)
