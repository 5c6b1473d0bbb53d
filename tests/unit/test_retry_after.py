"""Retry-After of a refusal: from the measured completion rate when the in-flight cap is
full, without a measurement when none is recent, bounded by the longest deadline, and as
HTTP's whole seconds (`app/admission.py`, `app/rate_meter.py`), on an injected clock."""

from __future__ import annotations

import math

import pytest

from app.admission import Admission, Entry, Rejected, RejectReason
from app.rate_meter import RateMeter
from tests.support.admission import limits, with_body


def _inflight_retry_after(step_s: float) -> float:
    """Complete one request every `step_s` for 30 s (six meter time constants), fill the
    in-flight cap, overflow it by one and return the Retry-After that gives."""
    admission = Admission(limits(3))
    now = 0.0
    while now < 30.0:
        now += step_s
        admission.leave(with_body(admission, now), now)
    for _ in range(3):
        with_body(admission, now)
    refused = admission.enter(now)
    assert isinstance(refused, Rejected) and refused.retry_after_s is not None
    return refused.retry_after_s


def test_inflight_retry_after_follows_the_measured_completion_rate() -> None:
    # One excess request at 10 completions/s clears in 100 ms; at 1/s in 1 s.
    assert _inflight_retry_after(0.1) == pytest.approx(1 / 10, rel=0.15)
    assert _inflight_retry_after(1.0) == pytest.approx(1.0, rel=0.15)


def test_inflight_retry_after_without_any_measurement_is_bounded() -> None:
    admission = Admission(limits(1))
    with_body(admission, now=0.0)
    refused = admission.enter(now=0.0)
    assert isinstance(refused, Rejected) and refused.retry_after_s == 1.0


def test_inflight_retry_after_after_a_quiet_spell_is_the_unknown_bound() -> None:
    """The completion rate decays while nothing completes: a minute after a busy spell
    (100/s) it said the next place frees in ~1,600 s, two minutes after in ~2.6e8 s, and
    after an hour 1/rate overflowed to inf (an OverflowError answering the request). A
    rate that old is no measurement: the unknown bound, as before any completion."""
    for quiet_s in (60.0, 120.0, 3600.0):
        admission = Admission(limits(3))
        now = 0.0
        while now < 30.0:
            now += 0.01
            admission.leave(with_body(admission, now), now)
        now += quiet_s
        for _ in range(3):
            with_body(admission, now)
        refused = admission.enter(now)
        assert isinstance(refused, Rejected) and refused.retry_after_s == 1.0, quiet_s
        assert refused.retry_after_header == "1"


def test_inflight_retry_after_is_at_most_the_longest_deadline() -> None:
    """A slow recent rate (one completion, 14 s ago) predicts ~82 s for a place to free;
    every request in flight has a deadline of at most `max_timeout_s`, so by then each has
    left."""
    admission = Admission(limits(1))
    admission.leave(with_body(admission, now=0.0), now=0.0)
    with_body(admission, now=14.0)
    refused = admission.enter(now=14.0)
    assert isinstance(refused, Rejected) and refused.retry_after_s is not None
    assert refused.retry_after_s == admission.limits.max_timeout_s


def test_retry_after_header_is_whole_seconds_at_least_one() -> None:
    assert Rejected(RejectReason.QUEUE, "x", 0.02).retry_after_header == "1"
    assert Rejected(RejectReason.QUEUE, "x", 2.01).retry_after_header == "3"
    assert Rejected(RejectReason.DRAINING, "x").retry_after_header is None


def test_retry_after_header_of_a_wait_that_is_not_finite_is_the_unknown_bound() -> None:
    # math.ceil raised on these: OverflowError (inf), ValueError (nan).
    assert Rejected(RejectReason.INFLIGHT, "x", math.inf).retry_after_header == "1"
    assert Rejected(RejectReason.INFLIGHT, "x", math.nan).retry_after_header == "1"


def test_rate_meter_decays_without_events() -> None:
    meter = RateMeter(tau_s=1.0)
    assert meter.rate(0.0) == 0.0
    for step in range(1, 201):
        meter.record(1, now=step * 0.01)  # 100 events/s for 2 s
    assert meter.rate(2.0) == pytest.approx(100.0 * (1 - math.exp(-2.0)), rel=0.05)
    assert meter.rate(4.0) == pytest.approx(meter.rate(2.0) * math.exp(-2.0), rel=1e-6)


def test_without_a_place_freed_lately_the_wait_is_how_long_places_have_been_held() -> None:
    """Places taken long ago with none freed since (slow generations filling the cap) are
    not a quiet spell: a place frees only as one of them leaves, so telling clients "1 s"
    had them back every second for tens of seconds. Every request leaves by its deadline,
    at most `max_timeout_s` (30 s here) after it entered: no longer than what is left of
    that for the place taken last."""
    admission = Admission(limits(2))
    admission.leave(with_body(admission, now=0.0), now=0.0)  # the last place freed
    with_body(admission, now=1.0)
    with_body(admission, now=4.0)  # the cap is full from here on
    refused = admission.enter(now=16.0)  # 16 s since a place was freed: no rate
    assert isinstance(refused, Rejected) and refused.retry_after_s == pytest.approx(12.0)
    later = admission.enter(now=24.0)  # held 20 s: each leaves within 10 s
    assert isinstance(later, Rejected) and later.retry_after_s == pytest.approx(10.0)
    nearly = admission.enter(now=33.5)  # held 29.5 s: each leaves within 0.5 s
    assert isinstance(nearly, Rejected) and nearly.retry_after_s == 1.0
    # Held past every deadline (a place is left only once the answer is written: a slow
    # reader of a long answer holds it past its deadline): nothing bounds the wait, and
    # "1 s" had every refused client back each second.
    past = admission.enter(now=60.0)
    assert isinstance(past, Rejected) and past.retry_after_s == admission.limits.max_timeout_s


def test_only_a_request_that_held_a_place_frees_one() -> None:
    """A reader past its body grace held no place under the cap, and neither did a body
    refused when it arrived: their leaving was recorded as places freed, so a cap full of
    slow requests looked like one draining, and clients were told to come back soon."""
    admission = Admission(limits(1))
    reader = admission.enter(now=0.0)  # its body never comes: its grace ends at 0.25 s
    assert isinstance(reader, Entry)
    with_body(admission, now=1.0)  # takes the place
    admission.leave(reader, now=2.0)  # frees nothing
    refused = admission.enter(now=3.0)
    assert isinstance(refused, Rejected)
    # No place freed yet: held for 2 s since the last taken (not 1 / the reader's "rate").
    assert refused.retry_after_s == pytest.approx(2.0)
