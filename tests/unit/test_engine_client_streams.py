"""How a request's stream ends on the front end (`StreamingClient`): outputs then a failure,
and an engine lost (exited: nothing to cancel; gone silent: cancelled there, since it may
recover). A transport that records what it sends: no socket, no engine."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from app.admission import Rejected, RejectReason
from app.engine.client import (
    ANSWER_UNREADABLE,
    ENGINE_EXITED,
    ENGINE_WENT_SILENT,
    EngineLoss,
    EngineNotConnected,
    EngineUnavailable,
    StreamingClient,
)
from app.engine.core import EngineCore
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import (
    Cancel,
    EmbedPayload,
    EngineStatus,
    Failure,
    FailureKind,
    FinishReason,
    GeneratePayload,
    Output,
    SamplingParams,
    Submit,
    ToEngine,
    TokensOutput,
)
from app.failures import DeadlineExceeded
from app.metrics import Metrics
from app.settings import Settings
from tests.support.engine_status import ready_status
from tests.support.manual_clock import ManualClock


class Recording(StreamingClient):
    def __init__(self) -> None:
        super().__init__(origin=b"fe-1-1")
        self.sent: list[ToEngine] = []
        self.submitted = asyncio.Event()

    def status(self) -> EngineStatus | None:
        return ready_status("e", time.monotonic())

    def _send(self, message: ToEngine) -> None:
        self.sent.append(message)
        if isinstance(message, Submit):
            self.submitted.set()


def generate(client: Recording) -> Submit:
    payload = GeneratePayload([1, 2], SamplingParams(max_new_tokens=8))
    return Submit(client.next_request_id(), "tiny", time.monotonic() + 60, payload)


def tokens(request_id: int, *token_ids: int) -> Output:
    return Output(request_id, False, TokensOutput(list(token_ids), 2), queue_s=0.0, compute_s=0.0)


async def read_all(client: StreamingClient, request: Submit, seen: list[Output]) -> None:
    async for output in client.stream(request):
        seen.append(output)


async def test_outputs_then_a_failure_reach_the_reader_in_order() -> None:
    """A generation past its deadline sends the tokens of its last step, then fails (504):
    zero or more outputs, then a final output or one failure."""
    client = Recording()
    request = generate(client)
    seen: list[Output] = []
    reading = asyncio.create_task(read_all(client, request, seen))
    await client.submitted.wait()
    client._deliver(tokens(request.request_id, 5))
    client._deliver(tokens(request.request_id, 6, 7))
    client._deliver(Failure(request.request_id, FailureKind.DEADLINE, "deadline passed"))
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(reading, 10)
    assert [output.payload for output in seen] == [
        TokensOutput([5], 2),
        TokensOutput([6, 7], 2),
    ]
    assert client.sent == [request]  # the engine ended it: nothing to cancel
    assert client.open_streams == 0


async def test_outputs_then_a_final_output_end_the_stream() -> None:
    client = Recording()
    request = generate(client)
    seen: list[Output] = []
    reading = asyncio.create_task(read_all(client, request, seen))
    await client.submitted.wait()
    client._deliver(tokens(request.request_id, 5))
    final = TokensOutput([6], 2, FinishReason.EOS)
    client._deliver(Output(request.request_id, True, final, queue_s=0.0, compute_s=0.0))
    await asyncio.wait_for(reading, 10)
    assert [output.final for output in seen] == [False, True]
    assert client.sent == [request]


@pytest.mark.parametrize(
    ("loss", "cancelled"),
    [(ENGINE_EXITED, False), (ENGINE_WENT_SILENT, True), (ANSWER_UNREADABLE, True)],
)
async def test_a_lost_engine_is_told_to_cancel_unless_it_exited(
    loss: EngineLoss, cancelled: bool
) -> None:
    """A stale status failed the request 503 but sent no Cancel: an engine whose loop only
    stalled went on computing it (holding its KV slot) for nobody."""
    client = Recording()
    request = Submit(client.next_request_id(), "m", time.monotonic() + 60, EmbedPayload([[1]]))
    seen: list[Output] = []
    reading = asyncio.create_task(read_all(client, request, seen))
    await client.submitted.wait()
    client._fail_all(loss)
    with pytest.raises(Rejected) as lost:
        await asyncio.wait_for(reading, 10)
    assert lost.value.reason is RejectReason.ENGINE_LOST
    assert str(lost.value) == loss.message
    expected: list[ToEngine] = [request, Cancel(request.request_id)] if cancelled else [request]
    assert client.sent == expected


def test_no_loss_says_the_engine_restarted_when_it_may_not_have() -> None:
    """The 503 said "the engine restarted" for a status that went stale, which proves no
    restart (and when no supervisor kills it, none happens)."""
    assert "restarted" not in ENGINE_WENT_SILENT.message
    assert "restarted" not in ANSWER_UNREADABLE.message


async def test_a_submit_that_never_went_out_is_not_cancelled() -> None:
    """A Submit refused on the front end (no engine status heard: `EngineNotConnected`)
    reached no engine; a Cancel for it, which a connected socket now lets through, told an
    engine about an id it never had."""

    class Unconnected(Recording):
        def _send(self, message: ToEngine) -> None:
            if isinstance(message, Submit):
                raise EngineNotConnected("no engine status heard")
            super()._send(message)

    client = Unconnected()
    request = generate(client)
    with pytest.raises(EngineNotConnected):
        await read_all(client, request, [])
    assert client.sent == []
    assert client.open_streams == 0


class SilentInProcess(InProcessEngine):
    """An in-process engine that never answers: only the client's silence timer ends a
    stream."""

    def _send(self, message: ToEngine) -> None:
        pass


async def test_the_silent_engine_timer_reads_the_clock_deadlines_are_on() -> None:
    """Deadlines are on the engine core's clock (the service's); the timer read the real
    one: with a clock 1000 s ahead, a request 50 ms from its deadline was given up on
    after 1000 s (and one on a clock behind, at once)."""
    clock = ManualClock(time.monotonic() + 1000)
    client = SilentInProcess(EngineCore(Settings(engine="inprocess"), Metrics(), clock=clock))
    client.answer_grace_s = 0.05
    request = Submit(client.next_request_id(), "m", clock() + 0.05, EmbedPayload([[1]]))
    with pytest.raises(EngineUnavailable, match="did not answer by the request's deadline"):
        await asyncio.wait_for(read_all(client, request, []), 5)

    clock.now = time.monotonic() - 1000  # behind: 60 s left on it
    request = Submit(client.next_request_id(), "m", clock() + 60, EmbedPayload([[1]]))
    reading = asyncio.create_task(read_all(client, request, []))
    await asyncio.sleep(0.3)
    assert not reading.done()
    reading.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reading
