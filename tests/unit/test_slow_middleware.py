"""`SlowRequestMiddleware` at the ASGI level, with an injected clock and inner apps that
stand in for the routes: a slow answer is reported with its status, and so is a slow
request whose route raised an error no handler answers (answered 500 further out, by
`ServerTimingMiddleware`)."""

from __future__ import annotations

import pytest
from starlette.types import Message, Receive, Scope, Send

from app.api.middleware import ServerTimingMiddleware
from app.api.slow import SlowRequestMiddleware
from app.failures import BatchFailed
from app.metrics import Metrics
from app.spikes.recorder import SlowRequestRecorder
from app.telemetry.probe import FakeProbe
from app.telemetry.sampler import ProcessTelemetry

SLOW_AFTER_S = 0.15


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stack(
    inner: object, clock: FakeClock
) -> tuple[ServerTimingMiddleware, SlowRequestRecorder, Metrics]:
    """The middlewares as `app/main.py` orders them: Server-Timing outside, then slow."""
    metrics = Metrics()
    recorder = SlowRequestRecorder(metrics, SLOW_AFTER_S, p99_multiple=None, keep=8)
    slow = SlowRequestMiddleware(
        inner,  # type: ignore[arg-type]
        recorder=recorder,
        telemetry=ProcessTelemetry("frontend", metrics, [FakeProbe()], clock=clock),
        is_inference=lambda path: path == "/infer",
        batching_window_s=0.002,
        clock=clock,
    )
    return ServerTimingMiddleware(slow, is_draining=lambda: False), recorder, metrics


async def call(app: ServerTimingMiddleware, path: str = "/infer") -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    await app(scope, receive, send)
    return sent


def failing_after(clock: FakeClock, seconds: float) -> object:
    """A route whose batch takes `seconds` in the compute phase and then fails on the
    server's side (`BatchFailed`: out of memory, the triage blamed the server)."""

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        clock.now += seconds
        scope["state"]["server_timing"].add("compute", seconds)
        raise BatchFailed("CUDA out of memory")

    return route


async def test_a_slow_request_ended_by_a_server_fault_is_reported_with_status_500() -> None:
    clock = FakeClock()
    app, recorder, metrics = stack(failing_after(clock, 0.4), clock)

    sent = await call(app)

    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 500
    [report] = recorder.recent()
    assert (report.path, report.status) == ("/infer", 500)
    assert report.total_s == pytest.approx(0.4)  # until the error, not until the 500 was sent
    assert report.facts.phases == {"compute": pytest.approx(0.4)}
    counted = metrics.registry.get_sample_value(
        "steadyserve_slow_requests_total", {"cause": report.top_cause}
    )
    assert counted == 1.0


async def test_a_quick_server_fault_is_not_slow_and_leaves_no_report() -> None:
    clock = FakeClock()
    app, recorder, _ = stack(failing_after(clock, 0.01), clock)

    sent = await call(app)

    assert sent[0]["status"] == 500
    assert recorder.recent() == []


async def test_a_slow_answered_request_is_reported_with_its_own_status() -> None:
    clock = FakeClock()

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        clock.now += 0.3
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    app, recorder, _ = stack(route, clock)
    await call(app)

    [report] = recorder.recent()
    assert report.status == 200 and report.total_s == pytest.approx(0.3)


async def test_a_fault_on_a_path_that_is_not_timed_is_not_reported() -> None:
    clock = FakeClock()
    app, recorder, _ = stack(failing_after(clock, 0.4), clock)

    sent = await call(app, path="/healthz")

    assert sent[0]["status"] == 500
    assert recorder.recent() == []


async def test_a_phase_run_off_the_loop_reaches_the_report_as_off_the_loop() -> None:
    """A large input tokenized on the tokenizer pool left the loop free; the report's facts
    must say so, or the loop's lateness meanwhile is taken for the request's own work."""
    clock = FakeClock()

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        timer = scope["state"]["server_timing"]
        clock.now += 0.3
        timer.add("tokenize", 0.3)
        timer.off_loop.add("tokenize")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    app, recorder, _ = stack(route, clock)
    await call(app)

    [report] = recorder.recent()
    assert report.facts.off_loop == frozenset({"tokenize"})
