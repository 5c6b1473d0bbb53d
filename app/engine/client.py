"""The front end's side of the engine protocol: send a request, read its stream of outputs.

`EngineClient` is what the front end's service calls; `StreamingClient` holds what every
transport shares (one queue per request, failures turned into exceptions, cancellation when
the reader stops early). A transport only says how a message reaches the engine (`_send`)
and hands back what arrives (`_deliver`). Front-end event loop thread only. Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

from app.admission import Rejected, RejectReason
from app.engine.identity import request_reference
from app.engine.protocol import (
    Cancel,
    DebugQuery,
    DebugReply,
    EngineRestart,
    EngineStatus,
    Failure,
    FailureKind,
    FromEngine,
    Output,
    Submit,
    ToEngine,
    payload_inputs,
)
from app.failures import (
    DEVICE_LOST,
    RETRY_AFTER_ENGINE_LOST_S,
    BatchFailed,
    DeadlineExceeded,
    DeviceLost,
    NonFiniteOutput,
)

log = logging.getLogger(__name__)

# The engine answers every request by its deadline (expiry is a 504 from the engine), give or
# take a batch or a multi-step run in flight; a stream silent this long after its deadline
# was lost by a fault, and its client must not wait for its own timeout.
ANSWER_GRACE_S = 5.0


class EngineRefused(Exception):
    """The engine could not serve the request as sent (answered 400); `input_index`: the
    input the model failed on, where that was why."""

    def __init__(self, message: str, input_index: int | None = None) -> None:
        super().__init__(message)
        self.input_index = input_index


class EngineUnavailable(Exception):
    """No engine can take the request now (not connected, or it is starting), or the one it
    was sent to stopped answering."""


class EngineNotConnected(EngineUnavailable):
    """Nothing was handed to an engine: none is connected. Another replica may take the
    request at once (unlike one an engine was sent and then never answered)."""


@dataclass(frozen=True, slots=True)
class EngineLoss:
    """Queued to every open stream when its engine is lost (`StreamingClient._fail_all`):
    each fails with a 503 `engine_lost` saying `message`. `engine_may_run_on`: nothing
    proves the engine is gone (its status went stale: a loop that stalled may recover; an
    answer could not be read), so each stream sends `Cancel` as it ends, lest the engine
    compute for nobody. Only a closed connection proves it dead."""

    message: str
    engine_may_run_on: bool


ENGINE_EXITED = EngineLoss("the engine exited while the request was in it; retry", False)
ENGINE_WENT_SILENT = EngineLoss(
    "the engine stopped answering while the request was in it; retry", True
)
ANSWER_UNREADABLE = EngineLoss("the engine's answer to the request could not be read; retry", True)


class _Silent:
    """Queued to a stream its engine left unanswered `ANSWER_GRACE_S` past its deadline."""


_SILENT = _Silent()
Queued = FromEngine | EngineLoss | _Silent


def failure_error(failure: Failure) -> Exception:
    """The exception a front end raises for an engine's `Failure`."""
    if failure.kind is FailureKind.REJECTED:
        reason = RejectReason(failure.reason or RejectReason.NOT_READY.value)
        return Rejected(reason, failure.message, failure.retry_after_s)
    if failure.kind is FailureKind.DEADLINE:
        return DeadlineExceeded(failure.message)
    if failure.kind is FailureKind.BAD_REQUEST:
        return EngineRefused(failure.message, failure.input_index)
    if failure.reason == DEVICE_LOST:  # its batch lost the engine its device: 500, not retried
        return DeviceLost(failure.message)
    if failure.reason == NonFiniteOutput.REASON:  # its text names the model, for the client
        return NonFiniteOutput(failure.message)
    return BatchFailed(failure.message)


def engine_lost(message: str) -> Rejected:
    return Rejected(RejectReason.ENGINE_LOST, message, RETRY_AFTER_ENGINE_LOST_S)


class EngineClient(Protocol):
    def status(self) -> EngineStatus | None:
        """The engine's last published status; None while no engine is connected."""
        ...

    def restart_under_way(self) -> EngineRestart | None:
        """The engine restart under way, as its supervisor published it: why the last engine
        was lost, until a new one is ready; None when none is (or none is published)."""
        ...

    async def start(self) -> None: ...

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Return once the engine is ready; raise `EngineUnavailable` if it fails or the
        time runs out (start-up scripts and tests)."""
        ...

    def refresh_metrics(self) -> None:
        """Bring engine-side gauges up to date before a scrape, where this process holds
        them (an engine in another process refreshes its own)."""
        ...

    async def close(self) -> None: ...

    def next_request_id(self) -> int: ...

    def inputs_in_transit(self, status: EngineStatus) -> int:
        """Inputs this front end sent that `status` (the engine's last published one) does
        not hold yet (on their way, or taken since it was published): front ends add them to
        the published backlog when shedding."""
        ...

    def stream(self, request: Submit) -> AsyncGenerator[Output, None]:
        """The request's outputs: zero or more, then either a `final` one or an exception
        (the outputs before it are yielded first): `Rejected`, `DeadlineExceeded`,
        `EngineRefused`, `BatchFailed` or `EngineUnavailable` (also when the engine stays
        silent `ANSWER_GRACE_S` past the deadline: a lost request). Leaving the loop early
        (or being cancelled) cancels the request in the engine."""
        ...

    def stream_batches(self, request: Submit) -> AsyncGenerator[list[Output], None]:
        """As `stream`, but each item is every output of the request that had arrived when
        its reader came back for more (one or several, in order): a reader that fell behind
        the engine catches up in one turn instead of one turn per output."""
        ...

    async def debug(self, what: str) -> dict[str, object]: ...


class StreamingClient:
    """Per-request queues and their life cycle; subclasses provide the transport and the
    engine's status. `origin` is how the engine knows this front end (its socket
    identity), the key of its `EngineStatus.taken_inputs`; `clock` is the one its
    requests' deadlines are on (the service's: time.monotonic but in tests)."""

    def __init__(self, origin: bytes, clock: Callable[[], float] = time.monotonic) -> None:
        self.origin = origin
        self._clock = clock
        self._streams: dict[int, asyncio.Queue[Queued]] = {}
        self._ids = itertools.count(1)
        # Inputs sent to the engine whose status was current at the time (a new engine
        # starts counting from zero, and what the old one took died with it).
        self._sent_inputs = 0
        self._sent_to: str | None = None
        self.answer_grace_s = ANSWER_GRACE_S

    def status(self) -> EngineStatus | None:
        raise NotImplementedError

    def restart_under_way(self) -> EngineRestart | None:
        return None  # no supervisor restarts an engine in this process's view

    def next_request_id(self) -> int:
        return next(self._ids)

    def inputs_in_transit(self, status: EngineStatus) -> int:
        if status.engine_id != self._sent_to:
            return 0
        return max(0, self._sent_inputs - status.taken_inputs.get(self.origin, 0))

    def _count_sent(self, request: Submit) -> None:
        status = self.status()
        engine_id = status.engine_id if status is not None else None
        if engine_id != self._sent_to:
            self._sent_to, self._sent_inputs = engine_id, 0
        self._sent_inputs += payload_inputs(request.payload)

    def _send(self, message: ToEngine) -> None:
        """Hand a message to the engine without blocking; raise `EngineUnavailable` if it
        cannot be delivered."""
        raise NotImplementedError

    def _deliver(self, message: FromEngine) -> None:
        queue = self._streams.get(message.request_id)
        if queue is not None:  # else: its reader left (cancelled) or it was failed already
            queue.put_nowait(message)

    def _fail_all(self, loss: EngineLoss = ENGINE_EXITED) -> None:
        """The engine was lost (`loss`: how): every open stream ends with a retryable 503,
        and cancels its request where the engine may still run it."""
        for queue in self._streams.values():
            queue.put_nowait(loss)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    async def stream(self, request: Submit) -> AsyncGenerator[Output, None]:
        async with contextlib.aclosing(self.stream_batches(request)) as batches:
            async for batch in batches:
                for output in batch:
                    yield output

    async def stream_batches(self, request: Submit) -> AsyncGenerator[list[Output], None]:
        request_id = request.request_id
        queue: asyncio.Queue[Queued] = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        sent = False  # a Cancel is for a Submit that went out, never for one refused here
        abandoned = False  # given up on while the engine may still hold it: cancel it there
        # One timer per request (not one per read): cheap on the front end's hot path.
        # (Bounded: an event loop's timer takes no infinite delay.)
        left_s = min(max(0.0, request.deadline - self._clock()), 86_400.0) + self.answer_grace_s
        silent = asyncio.get_running_loop().call_later(left_s, queue.put_nowait, _SILENT)
        try:
            self._send(request)
            sent = True
            self._count_sent(request)
            while not finished:
                batch: list[Output] = []
                error: Exception | None = None
                message = await queue.get()
                while True:
                    if isinstance(message, EngineLoss):
                        abandoned = message.engine_may_run_on
                        error = engine_lost(message.message)
                    elif isinstance(message, _Silent):
                        # The engine's fault, not the client's deadline: 503, retryable.
                        reference = request_reference(self.origin, request_id)
                        log.error("the engine never answered request %s; giving up", reference)
                        abandoned = True
                        error = EngineUnavailable(
                            "the engine did not answer by the request's deadline; retry"
                        )
                    elif isinstance(message, Failure):
                        error = failure_error(message)
                    elif isinstance(message, Output):
                        batch.append(message)
                    finished = error is not None or (bool(batch) and batch[-1].final)
                    if finished or queue.empty():
                        break
                    message = queue.get_nowait()
                if batch:  # the outputs before a failure are still the reader's
                    yield batch
                if error is not None:
                    raise error
        finally:
            silent.cancel()
            del self._streams[request_id]
            if sent and (not finished or abandoned):
                # Without an engine there is nothing to cancel.
                with contextlib.suppress(EngineUnavailable):
                    self._send(Cancel(request_id))

    async def debug(self, what: str) -> dict[str, object]:
        request_id = self.next_request_id()
        queue: asyncio.Queue[Queued] = asyncio.Queue()
        self._streams[request_id] = queue
        try:
            self._send(DebugQuery(request_id, what))
            message = await asyncio.wait_for(queue.get(), 5.0)
        finally:
            del self._streams[request_id]
        if not isinstance(message, DebugReply):
            raise EngineUnavailable("no debug report from the engine")
        return message.report
