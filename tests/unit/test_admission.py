"""Admission caps, deadlines and Retry-After against an injected clock."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest

from app.admission import (
    Admission,
    AdmissionLimits,
    RateMeter,
    Rejected,
    RejectReason,
    resolve_deadline,
)
from app.gate import AdmissionGate
from app.metrics import Metrics

LIMITS = AdmissionLimits(max_inflight=3, max_queue=10, default_timeout_s=5.0, max_timeout_s=30.0)


def test_requests_are_admitted_until_the_inflight_cap() -> None:
    admission = Admission(LIMITS)
    tickets = [admission.admit(1, deadline=10.0, now=0.0) for _ in range(3)]
    with pytest.raises(Rejected) as caught:
        admission.admit(1, deadline=10.0, now=0.0)
    assert caught.value.reason is RejectReason.INFLIGHT
    admission.release(tickets[0], now=0.1)
    admission.admit(1, deadline=10.0, now=0.1)


def test_the_queue_cap_counts_inputs_not_requests() -> None:
    admission = Admission(LIMITS)
    admission.admit(8, deadline=10.0, now=0.0)
    with pytest.raises(Rejected) as caught:
        admission.admit(3, deadline=10.0, now=0.0)
    assert caught.value.reason is RejectReason.QUEUE
    admission.admit(2, deadline=10.0, now=0.0)
    assert admission.queued == 10


def _retry_after_after_draining(inputs_per_step: int, step_s: float) -> float:
    """Drain a steady flow for 30 s (six meter time constants), fill the queue, overflow it
    by one input and return the Retry-After that gives."""
    admission = Admission(AdmissionLimits(1000, 10, 5.0, 30.0))
    now = 0.0
    while now < 30.0:
        now += step_s
        ticket = admission.admit(inputs_per_step, deadline=now + 5, now=now)
        admission.left_queue(inputs_per_step, now=now)
        admission.release(ticket, now=now)
    admission.admit(10, deadline=now + 5, now=now)
    with pytest.raises(Rejected) as caught:
        admission.admit(1, deadline=now + 5, now=now)
    assert caught.value.reason is RejectReason.QUEUE
    assert caught.value.retry_after_s is not None
    return caught.value.retry_after_s


def test_retry_after_follows_the_measured_drain_rate() -> None:
    # One excess input at 20 inputs/s drains in 50 ms; at 2 inputs/s in 500 ms.
    # (An exponentially decayed meter read just after an event runs slightly high.)
    assert _retry_after_after_draining(2, 0.1) == pytest.approx(1 / 20, rel=0.15)
    assert _retry_after_after_draining(2, 1.0) == pytest.approx(1 / 2, rel=0.15)


def test_retry_after_without_any_measurement_is_bounded() -> None:
    admission = Admission(AdmissionLimits(1, 10, 5.0, 30.0))
    admission.admit(1, deadline=5.0, now=0.0)
    with pytest.raises(Rejected) as caught:
        admission.admit(1, deadline=5.0, now=0.0)
    assert caught.value.retry_after_s == 1.0


def test_retry_after_header_is_whole_seconds_at_least_one() -> None:
    assert Rejected(RejectReason.QUEUE, "x", 0.02).retry_after_header == "1"
    assert Rejected(RejectReason.QUEUE, "x", 2.01).retry_after_header == "3"
    assert Rejected(RejectReason.DRAINING, "x").retry_after_header is None


def test_rate_meter_decays_without_events() -> None:
    meter = RateMeter(tau_s=1.0)
    assert meter.rate(0.0) == 0.0
    for step in range(1, 201):
        meter.record(1, now=step * 0.01)  # 100 events/s for 2 s
    assert meter.rate(2.0) == pytest.approx(100.0 * (1 - math.exp(-2.0)), rel=0.05)
    assert meter.rate(4.0) == pytest.approx(meter.rate(2.0) * math.exp(-2.0), rel=1e-6)


def test_deadline_is_the_tightest_of_client_and_proxy_and_bounded() -> None:
    assert resolve_deadline(10.0, LIMITS) == 15.0
    assert resolve_deadline(10.0, LIMITS, timeout_ms=200) == pytest.approx(10.2)
    assert resolve_deadline(10.0, LIMITS, timeout_ms=900, envoy_timeout_ms=300) == pytest.approx(
        10.3
    )
    assert resolve_deadline(10.0, LIMITS, timeout_ms=10**9) == 40.0
    assert resolve_deadline(10.0, LIMITS, envoy_timeout_ms=0) == 15.0  # 0 means "no timeout"


def test_a_passed_deadline_and_draining_are_rejected() -> None:
    admission = Admission(LIMITS)
    with pytest.raises(Rejected) as late:
        admission.admit(1, deadline=1.0, now=1.0)
    assert late.value.reason is RejectReason.DEADLINE
    admission.draining = True
    with pytest.raises(Rejected) as draining:
        admission.admit(1, deadline=10.0, now=1.0)
    assert draining.value.reason is RejectReason.DRAINING


def test_queue_high_water_is_reset_by_each_scrape() -> None:
    admission = Admission(LIMITS)
    ticket = admission.admit(7, deadline=10.0, now=0.0)
    admission.left_queue(7, now=0.1)
    admission.release(ticket, now=0.1)
    assert admission.take_queue_high_water() == 7
    assert admission.take_queue_high_water() == 0


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose time only moves when the test says (aiolimiter reads loop time)."""

    now = 1000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def virtual_loop() -> Iterator[VirtualClockLoop]:
    loop = VirtualClockLoop()
    yield loop
    loop.close()


def test_token_bucket_admits_a_burst_then_rejects_with_retry_after(
    virtual_loop: VirtualClockLoop,
) -> None:
    metrics = Metrics()
    admission = Admission(AdmissionLimits(100, 100, 5.0, 30.0))
    gate = AdmissionGate(
        admission, rate_per_s=10.0, burst=4, max_wait_s=0.0, metrics=metrics,
        clock=virtual_loop.time,
    )  # fmt: skip

    async def scenario() -> list[object]:
        outcomes: list[object] = []
        for _ in range(5):
            try:
                outcomes.append(await gate.admit("m", 1, deadline=virtual_loop.now + 5))
            except Rejected as rejection:
                outcomes.append(rejection)
        virtual_loop.now += 0.1  # refills one token at 10/s
        outcomes.append(await gate.admit("m", 1, deadline=virtual_loop.now + 5))
        return outcomes

    outcomes = virtual_loop.run_until_complete(scenario())
    rejected = outcomes[4]
    assert isinstance(rejected, Rejected)
    assert rejected.reason is RejectReason.RATE
    assert rejected.retry_after_s == pytest.approx(0.1)
    assert not any(isinstance(o, Rejected) for o in outcomes[:4] + outcomes[5:])
    assert metrics.rejected.labels("m", "rate")._value.get() == 1
