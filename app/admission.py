"""Pure admission policy: in-flight cap, queue cap, deadlines, draining, Retry-After.

No asyncio and no clock of its own: every call takes `now` (monotonic seconds). The token
bucket that sits in front of these caps is aiolimiter's, driven by `gate.py`; this module
turns its verdict and the caps into admit/reject decisions, and computes `Retry-After` from
the drain rate it measures (inputs and requests completed per second), not from a constant.

Only the event loop thread calls an `Admission`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class RejectReason(Enum):
    RATE = "rate"
    INFLIGHT = "inflight"
    QUEUE = "queue"
    DEADLINE = "deadline"
    DRAINING = "draining"
    NOT_READY = "not_ready"


class Rejected(Exception):
    """A request turned away; `retry_after_s` is set where waiting would help."""

    def __init__(self, reason: RejectReason, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str | None:
        """HTTP `Retry-After` is whole seconds: rounded up, at least 1."""
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_inflight: int
    max_queue: int
    default_timeout_s: float
    max_timeout_s: float


@dataclass(frozen=True, slots=True)
class Ticket:
    """An admitted request: how many inputs it queued and when it must be answered by."""

    n_inputs: int
    admitted_at: float
    deadline: float


class RateMeter:
    """Events per second, exponentially decayed with time constant `tau_s`.

    A continuous-time EWMA: each event adds 1/tau to the rate, which decays by exp(-dt/tau).
    """

    def __init__(self, tau_s: float = 5.0) -> None:
        self._tau = tau_s
        self._rate = 0.0
        self._last: float | None = None

    def record(self, count: int, now: float) -> None:
        self._rate = self.rate(now) + count / self._tau
        self._last = now

    def rate(self, now: float) -> float:
        if self._last is None:
            return 0.0
        return self._rate * math.exp(-max(0.0, now - self._last) / self._tau)


# When nothing has drained yet there is no measured rate; this bounds the guess.
_RETRY_AFTER_UNKNOWN_S = 1.0


def resolve_deadline(
    now: float,
    limits: AdmissionLimits,
    timeout_ms: float | None = None,
    envoy_timeout_ms: float | None = None,
) -> float:
    """The request's monotonic deadline: the tightest of what the client and the proxy asked
    for, the default when neither did, and never beyond `max_timeout_s`."""
    asked = [ms / 1000.0 for ms in (timeout_ms, envoy_timeout_ms) if ms is not None and ms > 0]
    timeout_s = min(asked) if asked else limits.default_timeout_s
    return now + min(timeout_s, limits.max_timeout_s)


class Admission:
    """Counts what is admitted and queued, and decides who gets in."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.inflight = 0
        self.queued = 0
        self._queue_high_water = 0
        self.draining = False
        self._inputs_drained = RateMeter()
        self._requests_completed = RateMeter()

    def admit(self, n_inputs: int, deadline: float, now: float) -> Ticket:
        """Admit a request of `n_inputs` inputs or raise `Rejected`; the caller has already
        passed the token bucket. On success the caller must later call `release`."""
        if self.draining:
            raise self.draining_rejection()
        if deadline <= now:
            raise Rejected(RejectReason.DEADLINE, "deadline passed before admission")
        if self.inflight + 1 > self.limits.max_inflight:
            excess = self.inflight + 1 - self.limits.max_inflight
            raise Rejected(
                RejectReason.INFLIGHT,
                f"{self.inflight} requests in flight (cap {self.limits.max_inflight})",
                self._time_to_drain(excess, self._requests_completed, now),
            )
        if self.queued + n_inputs > self.limits.max_queue:
            excess = self.queued + n_inputs - self.limits.max_queue
            raise Rejected(
                RejectReason.QUEUE,
                f"{self.queued} inputs queued (cap {self.limits.max_queue})",
                self._time_to_drain(excess, self._inputs_drained, now),
            )
        self.inflight += 1
        self.queued += n_inputs
        self._queue_high_water = max(self._queue_high_water, self.queued)
        return Ticket(n_inputs=n_inputs, admitted_at=now, deadline=deadline)

    def left_queue(self, n_inputs: int, now: float) -> None:
        """Inputs left the queue: started computing, or dropped (expired, cancelled)."""
        self.queued -= n_inputs
        self._inputs_drained.record(n_inputs, now)

    def release(self, ticket: Ticket, now: float) -> None:
        """The request was answered (whatever the outcome)."""
        self.inflight -= 1
        self._requests_completed.record(1, now)

    def take_queue_high_water(self) -> int:
        """The deepest the queue has been since the last call (a scrape), then reset."""
        high_water, self._queue_high_water = self._queue_high_water, self.queued
        return high_water

    @staticmethod
    def draining_rejection() -> Rejected:
        return Rejected(RejectReason.DRAINING, "server is draining; retry on another replica")

    def rate_limited(self, n_inputs: int, rate_per_s: float) -> Rejected:
        """The rejection for a request the token bucket could not serve in time: retry once
        the bucket has refilled `n_inputs` tokens."""
        return Rejected(
            RejectReason.RATE,
            f"over the admission rate of {rate_per_s:g} inputs/s",
            n_inputs / rate_per_s,
        )

    @staticmethod
    def _time_to_drain(excess: int, meter: RateMeter, now: float) -> float:
        rate = meter.rate(now)
        return excess / rate if rate > 0 else _RETRY_AFTER_UNKNOWN_S
