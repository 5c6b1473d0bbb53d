"""Shedding before the body is read counts the work this front end has let in but the
engine has not seen yet: without it, a burst of connections resending at once all pass on a
stale published backlog, have their bodies read and tokenized, and are then refused by the
engine (docs/BENCHMARKS.md). Also the engine client's side of it: what it counts in
transit, and a request the engine never answers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from app.admission import BODY_GRACE_S, Entry, Rejected, RejectReason
from app.api.errors import RETRY_ELSEWHERE_HEADER, engine_unavailable_headers
from app.engine.client import EngineNotConnected, EngineRefused, EngineUnavailable, StreamingClient
from app.engine.protocol import (
    Cancel,
    EmbedOutput,
    EmbedPayload,
    EngineStatus,
    Failure,
    FailureKind,
    ModelInfo,
    Output,
    Submit,
    ToEngine,
)
from app.failures import DeadlineExceeded
from app.metrics import Metrics
from app.model_specs import ModelSpec
from app.service import Service
from app.settings import Settings
from app.timing import PhaseTimer
from loadtest.null_engine import AlwaysReadyEngine

# 10 ms per queued input against a 100 ms budget: ten inputs fit.
SECONDS_PER_INPUT = 0.010
BUDGET_MS = 100.0


class PublishedStatus(AlwaysReadyEngine):
    """An engine whose status the test publishes by hand, and which never answers what it
    is sent (event loop thread only)."""

    def __init__(self, settings: Settings, least_own_compute_s: float) -> None:
        super().__init__(settings)
        self.backlog_s = 0.0
        self.published_at = 1.0
        self.least_own_compute_s = least_own_compute_s
        self.taken = 0  # inputs the published status says the engine took from us
        self.a_submit_sent = asyncio.Event()
        self.connected = True
        self.on_cancel: Callable[[Cancel], None] = lambda cancel: None

    # What it publishes it took is set by hand: what is in transit is counted for real.
    inputs_in_transit = StreamingClient.inputs_in_transit

    def model_info(self, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(task=spec.task, output_width=384, max_input_tokens=256)

    def status(self) -> EngineStatus | None:
        ready = super().status()
        assert ready is not None
        return EngineStatus(
            **{
                **{f: getattr(ready, f) for f in ready.__struct_fields__},
                "backlog_s": self.backlog_s,
                "seconds_per_input": SECONDS_PER_INPUT,
                "published_at": self.published_at,
                "least_own_compute_s": self.least_own_compute_s,
                "taken_inputs": {self.origin: self.taken},
            }
        )

    def publish(self, backlog_s: float, taken: int) -> None:
        self.backlog_s, self.taken = backlog_s, taken
        self.published_at += 1.0

    def _send(self, message: ToEngine) -> None:
        if not self.connected:
            raise EngineNotConnected("no engine is connected")
        if isinstance(message, Submit):
            self.a_submit_sent.set()
        elif isinstance(message, Cancel):
            self.on_cancel(message)


async def started_service(
    least_own_compute_s: float = 0.0, clock: Callable[[], float] | None = None
) -> tuple[Service, PublishedStatus]:
    settings = Settings(max_queue_delay_ms=BUDGET_MS, max_inflight=1000)
    engine = PublishedStatus(settings, least_own_compute_s)

    def no_tokenizer(spec: ModelSpec, largest: int) -> Any:
        return object()

    # A clock that stands still: requests let in stay within their body's grace
    # (admission.BODY_GRACE_S) however slowly the test runs.
    started_at = time.monotonic()
    service = Service(
        settings,
        Metrics(),
        engine,
        tokenizer_loader=no_tokenizer,
        clock=clock or (lambda: started_at),
    )
    await service.start()
    return service, engine


async def compute_one(service: Service, now: float, deadline: float, timer: PhaseTimer) -> None:
    """One single-input embed request, arrived `now`, through `Service.compute`."""
    await service.compute(
        service.resolve_model(None),
        "embed",
        EmbedPayload([[1]]),
        cost=1,
        deadline=deadline,
        arrived_at=now,
        timer=timer,
    )


def let_in(service: Service) -> list[Entry]:
    """Requests `shed` lets in before the first refusal (queue), each left in flight, its
    body not read yet."""
    entries = []
    while not isinstance(verdict := service.shed(None), Rejected):
        entries.append(verdict)
    assert verdict.reason is RejectReason.QUEUE
    return entries


async def test_requests_let_in_but_not_yet_sent_count_as_queued_work() -> None:
    service, _ = await started_service()
    # With nothing queued ahead one is always let in; then each waits behind the last.
    assert len(let_in(service)) == 11


def in_transit(engine: PublishedStatus) -> int:
    status = engine.status()
    assert status is not None
    return engine.inputs_in_transit(status)


async def send_one(service: Service, engine: PublishedStatus) -> asyncio.Task[None]:
    """Send one input of a request `shed` let in, as the routes do; the engine never
    answers it. Returns once it is sent; cancel the task to end it."""

    async def at_engine() -> None:
        request = Submit(engine.next_request_id(), "m", 1e12, EmbedPayload([[1, 2]]))
        with service.at_engine("m", "embed", time.monotonic()):
            async for _ in engine.stream(request):
                pass

    engine.a_submit_sent.clear()
    task = asyncio.create_task(at_engine())
    await engine.a_submit_sent.wait()
    return task


async def test_requests_whose_body_does_not_come_stop_counting_as_queued_work() -> None:
    # Headers, then no body (until the body timeout): past their grace they are no longer
    # work to come, and no longer hold the next requests off as a predicted queue.
    now = [time.monotonic()]
    service, _ = await started_service(clock=lambda: now[0])
    stalled = let_in(service)
    assert len(stalled) == 11
    now[0] += BODY_GRACE_S + 0.001
    arriving = let_in(service)
    assert len(arriving) == 11
    for entry in arriving:  # bodies that came at once: counted until they leave
        assert service.body_arrived(entry) is None
    now[0] += BODY_GRACE_S + 0.001
    assert len(let_in(service)) == 0
    assert (service.admission.reading, service.admission.with_body) == (11, 11)


async def test_sent_requests_count_until_the_engine_publishes_that_it_took_them() -> None:
    service, engine = await started_service()
    entries = let_in(service)
    assert len(entries) == 11
    sent = [await send_one(service, engine), await send_one(service, engine)]
    # Sent but not taken by the engine: still counted, so still full.
    assert in_transit(engine) == 2
    assert service.shed(None) is not None
    # A status published before the engine took them holds none of them: they still
    # count (counting only what was sent since the last status let 2 more in here).
    engine.publish(backlog_s=0.0, taken=0)
    assert service.shed(None) is not None
    # The engine took them: its backlog holds them now, the same total.
    engine.publish(backlog_s=2 * SECONDS_PER_INPUT, taken=2)
    assert in_transit(engine) == 0
    assert service.shed(None) is not None
    for task in sent:
        task.cancel()
    await asyncio.gather(*sent, return_exceptions=True)
    for entry in entries[:2]:
        service.body_arrived(entry)
        service.leave(entry)
    # Answered and gone: the engine's next status no longer holds them, 9 wait unsent.
    engine.publish(backlog_s=0.0, taken=2)
    assert len(let_in(service)) == 2


async def test_the_engines_least_own_compute_counts_as_the_engine_counts_it() -> None:
    # The engine admits a request only while backlog + its own batch's compute fits the
    # budget; a front end that left the latter out let in requests the engine refused
    # (in a 3x open loop, 6,915 in 10 s: docs/BENCHMARKS.md). 30 ms of it leaves room
    # for 7 queued inputs of 10 ms after the first.
    service, _ = await started_service(least_own_compute_s=0.030)
    assert len(let_in(service)) == 8


async def test_what_the_old_engine_was_sent_is_not_in_transit_to_a_new_one() -> None:
    service, engine = await started_service()
    sent = await send_one(service, engine)
    assert in_transit(engine) == 1
    engine.engine_id = "its-replacement"  # its status counts what it took from zero
    assert in_transit(engine) == 0
    sent.cancel()
    await asyncio.gather(sent, return_exceptions=True)


async def test_a_request_that_could_not_be_sent_is_not_in_transit() -> None:
    _, engine = await started_service()
    engine.connected = False
    request = Submit(engine.next_request_id(), "m", 1e12, EmbedPayload([[1], [2]]))
    with pytest.raises(EngineUnavailable):
        async for _ in engine.stream(request):
            pass
    assert in_transit(engine) == 0


async def test_a_request_the_engine_never_answers_ends_after_its_deadline() -> None:
    """A lost request (an engine fault) gives up past its deadline instead of holding its
    client until the client's own timeout; the engine is told to drop it."""
    _, engine = await started_service()
    engine.answer_grace_s = 0.0
    cancels: list[Cancel] = []
    engine.on_cancel = cancels.append
    request = Submit(engine.next_request_id(), "m", time.monotonic(), EmbedPayload([[1]]))
    # The engine's fault, retryable (503): it was a 504 "deadline", the client's timeout.
    with pytest.raises(EngineUnavailable, match="did not answer") as silent:
        async for _ in engine.stream(request):
            pass
    assert cancels == [Cancel(request.request_id)]
    # It reached an engine, which may have hung on it: not for another replica to try.
    assert RETRY_ELSEWHERE_HEADER not in engine_unavailable_headers(silent.value)


async def test_a_request_at_the_engine_is_timed_by_how_it_ended() -> None:
    service, _ = await started_service()
    endings: list[tuple[BaseException | None, str]] = [
        (None, "ok"),
        (Rejected(RejectReason.QUEUE, "full", 1.0), "rejected"),
        (Rejected(RejectReason.DEADLINE, "late"), "deadline"),
        (DeadlineExceeded("late in the queue"), "deadline"),
        (asyncio.CancelledError(), "cancelled"),
        (RuntimeError("a fault"), "error"),
        (EngineRefused("not as sent"), "bad_request"),  # a 400 is not the server's error
        (EngineUnavailable("no engine"), "rejected"),
    ]
    for error, _ in endings:
        with (
            contextlib.suppress(BaseException),
            service.at_engine("m", "embed", time.monotonic()) as outcome,
        ):
            if error is not None:
                raise error
            outcome.ok()
    assert service._at_engine == 0
    for name in ("ok", "rejected", "deadline", "cancelled", "error", "bad_request"):
        labels = {"model": "m", "task": "embed", "outcome": name}
        count = service.metrics.registry.get_sample_value(
            "steadyserve_request_duration_seconds_count", labels
        )
        assert count == sum(1 for _, want in endings if want == name), name
    # A 503 decided in the front end is a refusal no engine counts.
    refused = {"model": "m", "reason": "not_ready"}
    assert service.metrics.registry.get_sample_value("steadyserve_rejected_total", refused) == 1


async def test_time_at_an_engine_that_answers_only_its_deadline_is_queue_time() -> None:
    """No output came back to carry `queue_s`: the slow-request report called the whole
    wait "unaccounted", in exactly the overload it is meant to explain."""
    service, engine = await started_service()
    timer = PhaseTimer()
    now = time.monotonic()

    async def expire_it_at_the_engine() -> None:
        await engine.a_submit_sent.wait()
        request_id = next(iter(engine._streams))
        engine._deliver(Failure(request_id, FailureKind.DEADLINE, "deadline passed in the queue"))

    expiry = asyncio.create_task(expire_it_at_the_engine())
    with pytest.raises(DeadlineExceeded):
        await compute_one(service, now, now + 0.02, timer)  # never answered: given up then
    await expiry
    assert set(timer.phases) == {"admission", "queue"}


async def test_time_at_an_engine_that_went_away_is_the_engine_lost_phase() -> None:
    """The engine died with the request in it: the report called the wait "unaccounted"."""
    service, engine = await started_service()
    timer = PhaseTimer()
    now = time.monotonic()

    async def lose_the_engine() -> None:
        await engine.a_submit_sent.wait()
        engine._fail_all()

    lost = asyncio.create_task(lose_the_engine())
    with pytest.raises(Rejected) as refused:
        await compute_one(service, now, now + 10, timer)
    await lost
    assert refused.value.reason is RejectReason.ENGINE_LOST
    assert set(timer.phases) == {"admission", "engine_lost"}


async def test_a_request_answered_by_the_engine_has_closed_its_stream_on_return() -> None:
    """Left to the garbage collector, the stream of every answered request was closed later,
    through the loop's async-generator finalizer: a thread-safe wake-up and a task of its
    own per request, with the stream's deadline timer and queue held meanwhile."""
    service, engine = await started_service()
    now = time.monotonic()

    async def answer_it() -> None:
        await engine.a_submit_sent.wait()
        request_id = next(iter(engine._streams))
        engine._deliver(Output(request_id, True, EmbedOutput(bytes(4 * 384), 1, 384, 1), 0, 0))

    answering = asyncio.create_task(answer_it())
    await compute_one(service, now, now + 10, PhaseTimer())
    assert engine.open_streams == 0
    await answering
