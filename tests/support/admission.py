"""Admission as the unit tests drive it: limits, and requests let in with or without their
body (`app/admission.py`, pure, on an injected clock)."""

from __future__ import annotations

from app.admission import Admission, AdmissionLimits, Entry


def limits(max_inflight: int, max_body_reads: int = 1000) -> AdmissionLimits:
    return AdmissionLimits(max_inflight, 5.0, 30.0, max_body_reads)


def entered(admission: Admission, now: float) -> Entry:
    entry = admission.enter(now)
    assert isinstance(entry, Entry), entry
    return entry


def with_body(admission: Admission, now: float) -> Entry:
    """A request let in whose body arrives at once."""
    entry = entered(admission, now)
    assert admission.body_arrived(entry, now) is None
    return entry
