"""Admission by predicted delay, the in-flight cap, deadlines and Retry-After against an
injected clock."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from app.admission import (
    BODY_GRACE_S,
    Admission,
    AdmissionLimits,
    DelayEstimate,
    Rejected,
    RejectReason,
    delay_verdict,
)
from app.deadlines import resolve_deadline
from app.gate import AdmissionGate
from app.metrics import Metrics
from tests.support.admission import entered, limits, with_body

LIMITS = AdmissionLimits(
    max_inflight=3, default_timeout_s=5.0, max_timeout_s=30.0, max_body_reads=8
)


def test_requests_come_in_until_the_inflight_cap() -> None:
    admission = Admission(LIMITS)
    first, _, _ = [with_body(admission, now=0.0) for _ in range(3)]
    refused = admission.enter(now=0.0)
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.INFLIGHT
    admission.leave(first, now=0.1)
    with_body(admission, now=0.1)
    assert admission.inflight == 3


def test_a_body_that_follows_at_once_holds_its_place_from_the_headers() -> None:
    # A burst let in on one loop turn, bodies not read yet: the cap still bounds it.
    admission = Admission(LIMITS)
    burst = [entered(admission, now=0.0) for _ in range(3)]
    refused = admission.enter(now=0.1)
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.INFLIGHT
    assert [admission.body_arrived(entry, now=0.1) for entry in burst] == [None] * 3
    assert admission.held(now=0.1) == 3 and admission.reading == 0


def test_requests_whose_body_never_comes_cannot_starve_the_inflight_cap() -> None:
    # Headers, then nothing (until the body timeout, 5 s): past their grace they hold no
    # place, and everyone else still gets in.
    admission = Admission(LIMITS)
    stalled = [entered(admission, now=0.0) for _ in range(3)]
    now = BODY_GRACE_S + 0.001
    others = [with_body(admission, now) for _ in range(3)]
    assert admission.held(now) == 3 and admission.reading == 3 and admission.inflight == 6
    refused = admission.enter(now)  # the cap is full of requests with their body
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.INFLIGHT
    # A late body gets a place only if one is free; refused, it counts nowhere.
    late = admission.body_arrived(stalled[0], now)
    assert isinstance(late, Rejected) and late.reason is RejectReason.INFLIGHT
    admission.leave(stalled[0], now)
    admission.leave(others[0], now)
    assert admission.body_arrived(stalled[1], now) is None
    admission.leave(stalled[2], now + 5)  # cut off by the body timeout
    assert admission.held(now + 5) == 3 and admission.reading == 0
    for entry in [stalled[1], *others[1:]]:
        admission.leave(entry, now + 5)
    assert admission.inflight == admission.held(now + 5) == 0


@pytest.mark.parametrize("body_arrives", [True, False])
def test_a_request_whose_grace_ends_as_it_stops_reading_gives_its_place_back(
    body_arrives: bool,
) -> None:
    """Nothing else came in meanwhile, so its grace ended only when its body arrived (a slow
    upload on a quiet front end) or when it left (a client gone, a body timeout): its place
    was never given back, and each such request shrank the cap for good."""
    admission = Admission(LIMITS)
    for round_ in range(LIMITS.max_inflight + 1):
        now = 10.0 * round_
        entry = entered(admission, now)
        if body_arrives:
            later = now + BODY_GRACE_S + 1
            assert admission.body_arrived(entry, later) is None  # a place is free
            admission.leave(entry, later + 1)
        else:
            admission.leave(entry, now + 5)  # cut off by the body timeout
        assert admission.inflight == admission.held(now + 9) == 0, round_


def test_bodies_being_read_have_their_own_bounded_allowance() -> None:
    admission = Admission(limits(max_inflight=100, max_body_reads=4))
    stalled = [entered(admission, now=0.0) for _ in range(4)]
    refused = admission.enter(now=1.0)
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.INFLIGHT
    assert "bodies being read" in refused.message
    admission.leave(stalled[0], now=1.0)
    with_body(admission, now=1.0)


def test_a_body_counted_twice_or_after_leaving_changes_nothing() -> None:
    admission = Admission(LIMITS)
    entry = with_body(admission, now=0.0)
    assert admission.body_arrived(entry, now=0.0) is None
    assert admission.held(now=0.0) == 1
    admission.leave(entry, now=0.0)
    admission.leave(entry, now=0.0)
    assert admission.inflight == admission.held(now=0.0) == 0


def test_a_request_is_admitted_while_its_predicted_wait_fits_the_budget() -> None:
    # 60 ms of queued work ahead + 10 ms of its own = 70 ms against a 100 ms budget.
    fits = DelayEstimate(backlog_s=0.060, own_compute_s=0.010)
    assert delay_verdict(fits, deadline=10.0, now=0.0, max_queue_delay_s=0.100) is None


def test_a_predicted_wait_over_the_budget_is_refused_with_the_excess_as_retry_after() -> None:
    over = DelayEstimate(backlog_s=0.350, own_compute_s=0.010)
    rejection = delay_verdict(over, deadline=10.0, now=0.0, max_queue_delay_s=0.100)
    assert rejection is not None
    assert rejection.reason is RejectReason.QUEUE
    assert rejection.retry_after_s == pytest.approx(0.260)
    assert rejection.retry_after_header == "1"


def test_a_deadline_tighter_than_the_budget_bounds_the_wait() -> None:
    # 70 ms fits the 100 ms budget but not a deadline 50 ms away: the request's own
    # deadline cannot be met (504), which no Retry-After would change.
    estimate = DelayEstimate(backlog_s=0.060, own_compute_s=0.010)
    rejection = delay_verdict(estimate, deadline=1.050, now=1.0, max_queue_delay_s=0.100)
    assert rejection is not None and rejection.reason is RejectReason.DEADLINE
    assert rejection.retry_after_s is None
    assert delay_verdict(estimate, deadline=1.080, now=1.0, max_queue_delay_s=0.100) is None


def test_with_nothing_queued_ahead_a_slow_request_is_still_admitted() -> None:
    # Its own batch alone (measured on a busy machine) exceeds the budget; refusing it
    # could not get it served sooner.
    alone = DelayEstimate(backlog_s=0.0, own_compute_s=0.300)
    assert delay_verdict(alone, deadline=10.0, now=0.0, max_queue_delay_s=0.100) is None


def test_a_deadline_shorter_than_the_requests_own_compute_can_never_be_met() -> None:
    estimate = DelayEstimate(backlog_s=0.0, own_compute_s=0.020)
    rejection = delay_verdict(estimate, deadline=1.015, now=1.0, max_queue_delay_s=0.100)
    assert rejection is not None
    assert rejection.reason is RejectReason.DEADLINE
    assert rejection.retry_after_s is None


def test_deadline_is_the_tightest_of_client_and_proxy_and_bounded() -> None:
    assert resolve_deadline(10.0, LIMITS) == 15.0
    assert resolve_deadline(10.0, LIMITS, timeout_ms=200) == pytest.approx(10.2)
    # Envoy's less a margin (10 % of it, at most 100 ms), so the replica answers first
    assert resolve_deadline(10.0, LIMITS, timeout_ms=900, envoy_timeout_ms=300) == pytest.approx(
        10.27
    )
    assert resolve_deadline(10.0, LIMITS, timeout_ms=900, envoy_timeout_ms=200) == pytest.approx(
        10.18
    )
    assert resolve_deadline(10.0, LIMITS, timeout_ms=10**9) == 40.0
    assert resolve_deadline(10.0, LIMITS, envoy_timeout_ms=0) == 15.0  # 0 means "no timeout"


def test_a_replica_answers_before_envoys_own_timeout() -> None:
    """Envoy's route timer starts before the request reaches the replica: a replica whose
    deadline was Envoy's timeout answered after Envoy had timed out, and each such timeout
    counts against the replica (three in a row eject it: deploy/envoy/envoy.yaml)."""
    for route_timeout_ms in (10_000, 20_000):
        deadline = resolve_deadline(0.0, LIMITS, envoy_timeout_ms=route_timeout_ms)
        assert deadline == pytest.approx(route_timeout_ms / 1000 - 0.1)


def test_a_passed_deadline_is_refused_at_admission_and_draining_at_entry_only() -> None:
    admission = Admission(LIMITS)
    with pytest.raises(Rejected) as late:
        admission.admit(deadline=1.0, now=1.0)
    assert late.value.reason is RejectReason.DEADLINE
    admission.draining = True
    admission.admit(deadline=10.0, now=1.0)  # it entered before the drain: it finishes
    refused = admission.enter(now=1.0)
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.DRAINING


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
    admission = Admission(limits(100))
    gate = AdmissionGate(
        admission, rate_per_s=100.0, burst=40, max_wait_s=0.0, metrics=metrics,
        clock=virtual_loop.time,
    )  # fmt: skip

    async def scenario() -> list[object]:
        # Charged by tokens: four 10-token requests empty the 40-token bucket.
        outcomes: list[object] = []
        for _ in range(5):
            try:
                outcomes.append(await gate.admit("m", 10, deadline=virtual_loop.now + 5))
            except Rejected as rejection:
                outcomes.append(rejection)
        virtual_loop.now += 0.1  # refills ten tokens at 100/s
        outcomes.append(await gate.admit("m", 10, deadline=virtual_loop.now + 5))
        return outcomes

    outcomes = virtual_loop.run_until_complete(scenario())
    rejected = outcomes[4]
    assert isinstance(rejected, Rejected)
    assert rejected.reason is RejectReason.RATE
    assert rejected.retry_after_s == pytest.approx(0.1)
    assert not any(isinstance(o, Rejected) for o in outcomes[:4] + outcomes[5:])
    assert metrics.rejected.labels("m", "rate")._value.get() == 1


def test_a_request_refused_for_its_deadline_takes_no_bucket_tokens(
    virtual_loop: VirtualClockLoop,
) -> None:
    admission = Admission(limits(100))
    gate = AdmissionGate(
        admission, rate_per_s=100.0, burst=40, max_wait_s=0.0, metrics=Metrics(),
        clock=virtual_loop.time,
    )  # fmt: skip

    async def scenario() -> RejectReason:
        try:
            await gate.admit("m", 40, deadline=virtual_loop.now)
        except Rejected as rejection:
            reason = rejection.reason
        await gate.admit("m", 40, deadline=virtual_loop.now + 5)  # the whole bucket is left
        return reason

    assert virtual_loop.run_until_complete(scenario()) is RejectReason.DEADLINE
