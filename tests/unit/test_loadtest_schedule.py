"""Stages, arrival schedules, and the runner's timing checked in virtual time.

The runner takes its clock and its connections by injection. Here the clock is the clock
of an event loop whose time is virtual: whenever every task waits, the loop jumps to the
next timer instead of sleeping. A fake connection "serves" a request by sleeping its
service time on that clock, so every send time and latency is exact and the tests do not
depend on how fast or loaded the machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from loadtest.clocks import LoopClock
from loadtest.httpclient import RequestError, Response
from loadtest.records import ERROR_KINDS, Mode, RunConfig, RunResult
from loadtest.runner import Connection, LoadRun
from loadtest.stages import (
    Arrival,
    Stage,
    arrival_times,
    parse_duration,
    parse_stages,
    target_at,
    total_duration,
)
from tests.support.virtual_time import VirtualTimeLoop


def run_virtual(main: Callable[[], Awaitable[RunResult]]) -> RunResult:
    async def wrapper() -> RunResult:
        return await main()

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(wrapper())


class FakeConnection:
    """Answers after a service time taken from ``service_s`` (one per request, in order)."""

    def __init__(self, server: FakeServer) -> None:
        self._server = server

    @property
    def usable(self) -> bool:
        return True

    async def request(self, payload: bytes, timeout_s: float) -> Response:
        return await self._server.serve(payload)

    def close(self) -> None:
        self._server.closed += 1


class FakeServer:
    def __init__(
        self,
        service_s: float,
        statuses: list[int] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        self.service_s = service_s
        self.statuses = list(statuses or [])
        self.retry_after_s = retry_after_s
        self.arrivals: list[float] = []
        self.connections = 0
        self.closed = 0

    async def connect(self) -> Connection:
        self.connections += 1
        return FakeConnection(self)

    async def serve(self, payload: bytes) -> Response:
        self.arrivals.append(asyncio.get_running_loop().time())
        await asyncio.sleep(self.service_s)
        status = self.statuses.pop(0) if self.statuses else 200
        return Response(status, self.retry_after_s if status == 429 else None, 2)


def open_run(server: FakeServer, stages: list[Stage], **overrides: Any) -> RunResult:
    config = RunConfig(mode=Mode.OPEN, stages=tuple(stages), **overrides)
    return run_virtual(lambda: LoadRun(config, [b"x"], server.connect, clock=LoopClock()).run())


def relative(values: Any, result: RunResult) -> list[float]:
    return (np.frombuffer(values, dtype=np.float64) - result.started_at).tolist()


# -- stages and schedules ----------------------------------------------------------------


def test_parse_duration_units() -> None:
    assert parse_duration("250ms") == pytest.approx(0.25)
    assert parse_duration("20s") == 20.0
    assert parse_duration("2m") == 120.0
    assert parse_duration("1.5") == 1.5
    with pytest.raises(ValueError):
        parse_duration("soon")


def test_parse_stages_holds_and_ramps() -> None:
    stages = parse_stages("10s:50-500, 30s:500,5s:500-0")
    assert stages == [Stage(10, 50, 500), Stage(30, 500, 500), Stage(5, 500, 0)]
    assert total_duration(stages) == 45
    assert target_at(stages, 5.0) == pytest.approx(275.0)
    assert target_at(stages, 20.0) == 500.0
    assert target_at(stages, 42.5) == pytest.approx(250.0)
    assert target_at(stages, 99.0) == 0.0
    with pytest.raises(ValueError):
        parse_stages("10s")


def test_constant_arrivals_are_evenly_spaced() -> None:
    times = list(arrival_times([Stage(1.0, 100, 100)], Arrival.CONSTANT))
    assert len(times) == 100
    assert np.allclose(np.diff(times), 0.01)
    assert times[0] == 0.0


def test_ramp_arrivals_follow_the_integral_of_the_rate() -> None:
    # 0 -> 1000 req/s over 2 s: 1000 arrivals, the k-th at sqrt(2k * D / b).
    times = np.array(list(arrival_times([Stage(2.0, 0, 1000)], Arrival.CONSTANT)))
    assert times.size == 1000
    k = np.arange(1000)
    assert np.allclose(times, np.sqrt(2 * k * 2.0 / 1000))
    assert np.count_nonzero(times < 1.0) == 250  # a quarter of the area lies in the first half


def test_ramp_down_then_hold_stays_ordered_and_complete() -> None:
    stages = [Stage(1.0, 300, 100), Stage(1.0, 100, 100)]
    times = list(arrival_times(stages, Arrival.CONSTANT))
    assert len(times) == 300  # 200 in the ramp, 100 in the hold
    assert bool(np.all(np.diff(times) > 0))
    assert max(times) < 2.0


def test_poisson_arrivals_are_seeded_and_have_exponential_gaps() -> None:
    stages = [Stage(100.0, 200, 200)]
    first = list(arrival_times(stages, Arrival.POISSON, seed=11))
    again = list(arrival_times(stages, Arrival.POISSON, seed=11))
    assert first == again
    gaps = np.diff(first)
    # 20 000 expected arrivals: the count and mean gap are within a few standard errors.
    assert abs(len(first) - 20_000) < 5 * np.sqrt(20_000)
    assert gaps.mean() == pytest.approx(1 / 200, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 200, rel=0.05)  # exponential: std == mean


# -- open loop in virtual time --------------------------------------------------------------


def test_open_loop_sends_at_the_scheduled_times() -> None:
    server = FakeServer(service_s=0.005)
    result = open_run(server, [Stage(0.1, 100, 100)], connections=4)
    expected = [0.01 * k for k in range(10)]
    assert np.allclose(relative(result.recorder.sent, result), expected)
    assert np.allclose(np.array(server.arrivals) - result.started_at, expected)
    latency = np.frombuffer(result.recorder.done) - np.frombuffer(result.recorder.scheduled)
    assert np.allclose(latency, 0.005)
    assert list(result.recorder.status) == [200] * 10


def test_open_loop_counts_latency_from_the_schedule_when_the_client_is_late() -> None:
    # One connection, 25 ms service, a request due every 10 ms: each request waits for
    # the connection, and that wait is part of its latency (no coordinated omission).
    server = FakeServer(service_s=0.025)
    result = open_run(server, [Stage(0.05, 100, 100)], connections=1)
    scheduled = relative(result.recorder.scheduled, result)
    sent = relative(result.recorder.sent, result)
    done = relative(result.recorder.done, result)
    assert np.allclose(scheduled, [0.0, 0.01, 0.02, 0.03, 0.04])
    assert np.allclose(sent, [0.0, 0.025, 0.05, 0.075, 0.1])
    latency = np.array(done) - np.array(scheduled)
    assert np.allclose(latency, [0.025 + 0.015 * k for k in range(5)])
    assert server.connections == 1


def test_open_loop_poisson_schedule_is_what_gets_sent() -> None:
    server = FakeServer(service_s=0.001)
    stages = [Stage(1.0, 200, 200)]
    result = open_run(server, stages, connections=64, arrival=Arrival.POISSON, seed=5)
    expected = list(arrival_times(stages, Arrival.POISSON, seed=5))
    assert np.allclose(relative(result.recorder.sent, result), expected)


def test_open_loop_honors_retry_after_and_counts_retries() -> None:
    server = FakeServer(service_s=0.002, statuses=[429], retry_after_s=0.5)
    result = open_run(server, [Stage(0.01, 100, 100)], connections=2, retry_429=True)
    recorder = result.recorder
    assert list(recorder.status) == [200]
    assert list(recorder.retries) == [1]
    assert (recorder.retried_requests, recorder.retry_attempts) == (1, 1)
    assert np.allclose(np.array(server.arrivals) - result.started_at, [0.0, 0.502])
    # Latency spans the rejection, the wait and the retry.
    assert recorder.done[0] - recorder.scheduled[0] == pytest.approx(0.504)


def test_open_loop_stops_retrying_after_max_retries() -> None:
    server = FakeServer(service_s=0.001, statuses=[429] * 10, retry_after_s=0.1)
    result = open_run(server, [Stage(0.01, 100, 100)], connections=1, retry_429=True, max_retries=2)
    assert list(result.recorder.status) == [429]
    assert list(result.recorder.retries) == [2]
    assert len(server.arrivals) == 3


def test_open_loop_without_retry_records_the_429() -> None:
    server = FakeServer(service_s=0.001, statuses=[429], retry_after_s=1.0)
    result = open_run(server, [Stage(0.01, 100, 100)], connections=1)
    assert list(result.recorder.status) == [429]
    assert result.recorder.retried_requests == 0


def test_open_loop_gives_up_on_requests_still_outstanding_after_the_drain_timeout() -> None:
    server = FakeServer(service_s=60.0)
    result = open_run(server, [Stage(0.02, 100, 100)], connections=8, drain_timeout_s=0.5)
    assert [ERROR_KINDS[code] for code in result.recorder.error] == ["unfinished", "unfinished"]
    assert result.finished_at - result.started_at == pytest.approx(0.52, abs=0.02)


def test_transport_errors_are_recorded_by_kind_and_the_connection_replaced() -> None:
    class FailingOnce(FakeServer):
        async def serve(self, payload: bytes) -> Response:
            if not self.arrivals:
                self.arrivals.append(asyncio.get_running_loop().time())
                raise RequestError(RequestError.CLOSED, "reset")
            return await super().serve(payload)

    server = FailingOnce(service_s=0.001)
    result = open_run(server, [Stage(0.02, 100, 100)], connections=1)
    assert [ERROR_KINDS[code] for code in result.recorder.error] == ["closed", ""]
    assert list(result.recorder.status) == [0, 200]
    assert server.connections == 2


# -- closed loop in virtual time ------------------------------------------------------------


def test_closed_loop_sends_back_to_back_on_each_connection() -> None:
    server = FakeServer(service_s=0.01)
    config = RunConfig(mode=Mode.CLOSED, stages=(Stage(0.1, 2, 2),))
    result = run_virtual(lambda: LoadRun(config, [b"x"], server.connect, clock=LoopClock()).run())
    sent = np.array(relative(result.recorder.sent, result))
    done = np.array(relative(result.recorder.done, result))
    assert server.connections == 2
    assert np.all(sent < 0.1 + 1e-9)  # nothing starts after the run's duration
    # Two connections, each busy all the time: every 10 ms, two requests start.
    assert np.allclose(np.sort(sent)[:20], np.repeat(np.arange(10) * 0.01, 2))
    assert np.allclose(done - sent, 0.01)


def test_closed_loop_ramp_adds_connections_as_the_target_rises() -> None:
    server = FakeServer(service_s=0.01)
    # Target 1 + 11 t: 2 connections from the 50 ms tick, 5 from the 350 ms one (targets
    # chosen clear of the x.5 rounding points, which float time would make ambiguous).
    config = RunConfig(mode=Mode.CLOSED, stages=(Stage(0.4, 1, 5.4),))
    result = run_virtual(lambda: LoadRun(config, [b"x"], server.connect, clock=LoopClock()).run())
    sent = np.array(relative(result.recorder.sent, result))
    # Window edges sit between the 10 ms send grid points, clear of rounding.
    early = np.count_nonzero(sent < 0.045)
    late = np.count_nonzero((sent > 0.355) & (sent < 0.395))
    assert server.connections == 5
    assert early == 5  # one connection until the first tick raises the target
    assert late == 20  # five connections, four sends each, at the end
