"""Pure admission policy: admission by predicted delay, the in-flight cap, deadlines,
draining, Retry-After.

No asyncio and no clock of its own: every call takes `now` (monotonic seconds). The token
bucket that sits in front (charged by tokens) is aiolimiter's, driven by `gate.py`.

A request is admitted only while its predicted wait (the queued work ahead of it, measured
per shape, divided among the compute threads, plus its own batch) fits both its deadline and
the queue-delay budget (`delay_verdict`): the engine applies it to every request, front ends
to each model's last published queue before reading a body (`model_queues.py`).
`Retry-After` comes from the predicted excess or the measured completion rate.

Only the event loop thread of its process calls an `Admission`.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from app.rate_meter import RateMeter


class RejectReason(Enum):
    RATE = "rate"
    INFLIGHT = "inflight"
    QUEUE = "queue"
    DEADLINE = "deadline"
    DRAINING = "draining"
    NOT_READY = "not_ready"
    ENGINE_LOST = "engine_lost"  # the engine process died with the request in it
    # A front end holds `max_connections` connections: answered by its HTTP protocol alone
    # (`api/shedding_protocol.py`), never by the app.
    CONNECTIONS = "connections"

    @property
    def retry_elsewhere(self) -> bool:
        """The request did no work anywhere, so another replica may take it at once (a
        proxy retries it there): every refusal but a lost engine (the request may be what
        killed it: retried on each replica in turn, it would kill theirs) and a deadline
        (no time is left for another try)."""
        return self not in (RejectReason.ENGINE_LOST, RejectReason.DEADLINE)


class Rejected(Exception):
    """A request turned away; `retry_after_s` is set where waiting would help."""

    def __init__(self, reason: RejectReason, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str | None:
        """HTTP `Retry-After`, from `retry_after_whole_s`."""
        whole = self.retry_after_whole_s
        return None if whole is None else str(whole)

    @property
    def retry_after_whole_s(self) -> int | None:
        """What the client is told to wait: HTTP's `Retry-After` is whole seconds, so
        `retry_after_s` rounded up, at least 1 (a wait that is not finite is unknown:
        `RETRY_AFTER_UNKNOWN_S`)."""
        if self.retry_after_s is None:
            return None
        if not math.isfinite(self.retry_after_s):
            return math.ceil(RETRY_AFTER_UNKNOWN_S)
        return max(1, math.ceil(self.retry_after_s))


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_inflight: int
    default_timeout_s: float
    max_timeout_s: float
    max_body_reads: int  # requests let in whose body is still arriving


# A body normally follows its headers within a round trip. For this long after its headers a
# request counts against the in-flight cap (and as work to come) as if its body were there,
# so a burst let in on one event-loop turn is bounded as before; past it, a missing body
# counts only against `max_body_reads`, and the request takes a place again when its body
# arrives, if one is free.
BODY_GRACE_S = 0.25


@dataclass(frozen=True, slots=True)
class Entry:
    """A request `Admission.enter` let in from its headers, until it leaves."""

    number: int
    entered_at: float


@dataclass(frozen=True, slots=True)
class DelayEstimate:
    """Predicted seconds of queued work ahead of a request (already divided among the compute
    threads) and of the request's own batch."""

    backlog_s: float
    own_compute_s: float

    @property
    def wait_s(self) -> float:
        return self.backlog_s + self.own_compute_s


@dataclass(frozen=True, slots=True)
class BatchQueue:
    """The queue a request would join, as admission sees it: `backlog_s` is every running
    and queued batch's compute divided among the compute threads, counting each queued
    input at the full-batch rate (`seconds_per_input`, already divided too); `queued` of
    those inputs are in the request's own length bucket, whose full batch has `batch_rows`
    rows and computes for `full_batch_s` (not divided)."""

    backlog_s: float
    queued: int
    seconds_per_input: float
    batch_rows: int
    full_batch_s: float


def batch_delay(queue: BatchQueue, rows: int, partial_batch_s: float) -> DelayEstimate:
    """The wait of a request of `rows` inputs counted in whole batches: its last input runs
    in batch number (queued + rows - 1) // batch_rows of its bucket, so the batches before
    that one are ahead of it, not its queued inputs one by one. Behind a full batch, load
    is what queued it, and the request's own batch fills behind it too: its own compute is
    a full batch's. Otherwise it runs with what is queued, `partial_batch_s` (the caller's
    estimate for that batch: the engine's for its padded shape, a front end's least).

    Counting inputs one by one (`backlog_s` alone) admitted a request behind a long queue
    and left out the inputs that fill its own batch after it: under overload an admitted
    request waited up to a batch longer than the budget. Counting a full own batch for
    every request refused requests of a loop that never queues a full batch (64
    connections, batches of 32) behind a batch just started (docs/BENCHMARKS.md).

    Of those batches, as many as its rows would fill alone are its own compute
    (`own_compute_s`, its last batch included); the rest were added by the inputs queued
    ahead of it (`backlog_s`). A request of more rows than a batch, on an idle engine, has
    nothing ahead of it and is admitted: counted as backlog, its own earlier batches had it
    refused (429, and every retry too). One that others' inputs push into an extra batch
    waits that batch."""
    batch_rows = max(1, queue.batch_rows)
    last_batch = (queue.queued + rows - 1) // batch_rows  # the batch its last input runs in
    own_batches = -(-rows // batch_rows)  # the batches its rows fill alone
    full_batch_of_inputs_s = batch_rows * queue.seconds_per_input
    running_s = max(0.0, queue.backlog_s - queue.queued * queue.seconds_per_input)
    backlog = running_s + (last_batch + 1 - own_batches) * full_batch_of_inputs_s
    last = max(queue.full_batch_s, partial_batch_s) if last_batch > 0 else partial_batch_s
    own = (own_batches - 1) * full_batch_of_inputs_s + last
    return DelayEstimate(backlog_s=backlog, own_compute_s=own)


class PublishedQueue(Protocol):
    """The engine's queue as its status publishes it (`EngineStatus` is one)."""

    @property
    def backlog_s(self) -> float: ...
    @property
    def queued_inputs(self) -> int: ...
    @property
    def seconds_per_input(self) -> float: ...
    @property
    def batch_rows(self) -> int: ...
    @property
    def full_batch_s(self) -> float: ...
    @property
    def least_own_compute_s(self) -> float: ...


def published_queue_verdict(
    published: PublishedQueue, sent: int, deadline: float, now: float, budget_s: float
) -> Rejected | None:
    """A front end's verdict, before reading a request's body, from the engine's queue as
    last published plus `sent` inputs the engine does not hold yet, plus the least the
    engine adds for a request's own batch: without the last two, a burst of connections
    resending at once all passed, had their bodies read and tokenized, and were then refused
    by the engine. Not the front end's own event-loop lag: under a closed-loop flood the
    cheap refusals themselves keep the loop busy, and counting that lag refused nearly
    everything, collapsing goodput (measured: docs/BENCHMARKS.md). Counted in whole batches
    as the engine counts them (`batch_delay`), from the published full batch;
    `least_own_compute_s` for a batch not yet full."""
    queue = BatchQueue(
        backlog_s=published.backlog_s + sent * published.seconds_per_input,
        queued=published.queued_inputs + sent,
        seconds_per_input=published.seconds_per_input,
        batch_rows=published.batch_rows,
        full_batch_s=published.full_batch_s,
    )
    estimate = batch_delay(queue, 1, published.least_own_compute_s)
    return delay_verdict(estimate, deadline, now, budget_s)


def delay_verdict(
    estimate: DelayEstimate, deadline: float, now: float, max_queue_delay_s: float
) -> Rejected | None:
    """None to admit; else why not. A deadline shorter than the request's own compute, or
    than the wait ahead of it when that deadline is tighter than the budget, cannot be met
    (504 `deadline`); a wait over the server's budget is retryable (429 `queue`, retry once
    the excess has drained). With nothing queued ahead, a request is admitted whatever its
    own estimate: refusing it could not get it served sooner."""
    time_left = deadline - now
    if time_left <= estimate.own_compute_s:
        return Rejected(
            RejectReason.DEADLINE,
            f"the deadline leaves {max(0.0, time_left) * 1000:.0f} ms, less than the "
            f"{estimate.own_compute_s * 1000:.0f} ms this request computes for",
        )
    budget = min(max_queue_delay_s, time_left)
    if estimate.wait_s <= budget or estimate.backlog_s <= 0:
        return None
    if time_left < max_queue_delay_s:
        # The request's own deadline, not the server's budget, is what the wait exceeds.
        return Rejected(
            RejectReason.DEADLINE,
            f"predicted wait {estimate.wait_s * 1000:.0f} ms exceeds the request's deadline "
            f"({time_left * 1000:.0f} ms away)",
        )
    return Rejected(
        RejectReason.QUEUE,
        f"predicted wait {estimate.wait_s * 1000:.0f} ms exceeds the {budget * 1000:.0f} ms budget",
        estimate.wait_s - budget,
    )


# A refusal's wait when nothing measured it yet (no rate of places freed, no step time):
# every 429 still says when to retry.
RETRY_AFTER_UNKNOWN_S = 1.0


class Admission:
    """A front end's requests let in (those whose body is still arriving, and those whose
    body arrived), its in-flight cap, its allowance for bodies being read and its draining
    flag.

    What method, path and headers decide is decided before the body is read (`enter`), but
    a request whose body does not follow holds no place under the in-flight cap for long:
    slow or absent bodies (up to `STEADY_BODY_READ_TIMEOUT_S` each) cannot starve the cap,
    only fill their own bounded allowance (`max_body_reads`)."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.draining = False
        self.with_body = 0  # let in, body arrived: counted in flight until they leave
        self._bodied: set[int] = set()
        self._reading: dict[int, float] = {}  # let in, body still arriving: when they entered
        # Readers in the order they entered, while within BODY_GRACE_S (those gone since
        # are skipped when their grace ends), and how many of them are still reading.
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_reading = 0
        self._grace_cutoff = -math.inf
        self._numbers = itertools.count()
        # Places freed (what a refused request waits for), and when one was last taken.
        self._places_freed = RateMeter()
        self._place_taken_at: float | None = None

    @property
    def inflight(self) -> int:
        """Requests let in and not yet answered, their bodies arrived or not."""
        return self.with_body + len(self._reading)

    @property
    def reading(self) -> int:
        """Requests let in whose body is still arriving."""
        return len(self._reading)

    def held(self, now: float) -> int:
        """What the in-flight cap bounds: requests whose body arrived, and those whose body
        may still follow at once (within BODY_GRACE_S of their headers)."""
        self._end_grace(now)
        return self.with_body + self._recent_reading

    def enter(self, now: float) -> Entry | Rejected:
        """A request arrives (its headers, before its body is read): its `Entry` if it may
        come in, counted as reading until `body_arrived` or `leave`; else why not (draining,
        the in-flight cap, the allowance for bodies being read, with a Retry-After from the
        measured completion rate). Counting from arrival bounds the work a front end takes
        on wherever it waits."""
        if self.draining:
            return self.draining_rejection()
        held = self.held(now)
        if held >= self.limits.max_inflight:
            return Rejected(
                RejectReason.INFLIGHT,
                f"{held} requests in flight (cap {self.limits.max_inflight})",
                self._time_to_drain(held + 1 - self.limits.max_inflight, now),
            )
        if len(self._reading) >= self.limits.max_body_reads:
            return Rejected(
                RejectReason.INFLIGHT,
                f"{len(self._reading)} request bodies being read "
                f"(cap {self.limits.max_body_reads})",
                self._time_to_drain(1, now),
            )
        entry = Entry(next(self._numbers), now)
        self._place_taken_at = now  # held from its headers, while within its grace
        self._reading[entry.number] = now
        self._recent.append((now, entry.number))
        self._recent_reading += 1
        return entry

    def body_arrived(self, entry: Entry, now: float) -> Rejected | None:
        """The request's body arrived in full: None once it counts in flight (until
        `leave`). One whose body came within its grace kept its place; a later one takes a
        free place, or is refused (429 `inflight`: the cap filled while its body was
        read) and counts nowhere until it leaves. Calling it again changes nothing."""
        if entry.number not in self._reading:
            return None
        kept_its_place = self._stop_reading(entry, now)
        if not kept_its_place and (held := self.held(now)) >= self.limits.max_inflight:
            return Rejected(
                RejectReason.INFLIGHT,
                f"{held} requests in flight (cap {self.limits.max_inflight}) when its body arrived",
                self._time_to_drain(held + 1 - self.limits.max_inflight, now),
            )
        if not kept_its_place:
            self._place_taken_at = now
        self.with_body += 1
        self._bodied.add(entry.number)
        return None

    def leave(self, entry: Entry, now: float) -> None:
        """A request that entered was answered (whatever the outcome). Only one that held
        a place frees one: a reader past its grace, or a body refused when it arrived, did
        not, and counted as completions they made a cap full of slow requests look fast."""
        freed = False
        if entry.number in self._reading:
            freed = self._stop_reading(entry, now)
        elif entry.number in self._bodied:
            self._bodied.remove(entry.number)
            self.with_body -= 1
            freed = True
        if freed:
            self._places_freed.record(1, now)

    def admit(self, deadline: float, now: float) -> None:
        """Admit a request after its body was read and tokenized, or raise `Rejected` (its
        deadline passed). Draining refuses nothing here: the request entered before the drain
        began (`enter` refuses those after), and entered requests finish."""
        if deadline <= now:
            raise Rejected(RejectReason.DEADLINE, "deadline passed before admission")

    def _stop_reading(self, entry: Entry, now: float) -> bool:
        """Forget a reader; True when it was still within its grace (it held a place)."""
        # Grace ended first, while it is still a reader: `_end_grace` gives back the place
        # of each reader whose grace ends now, and would skip one already forgotten.
        self._end_grace(now)
        del self._reading[entry.number]
        if entry.entered_at > self._grace_cutoff:
            self._recent_reading -= 1
            return True
        return False

    def _end_grace(self, now: float) -> None:
        self._grace_cutoff = max(self._grace_cutoff, now - BODY_GRACE_S)
        while self._recent and self._recent[0][0] <= self._grace_cutoff:
            _, number = self._recent.popleft()
            if number in self._reading:
                self._recent_reading -= 1

    @staticmethod
    def draining_rejection() -> Rejected:
        return Rejected(RejectReason.DRAINING, "server is draining; retry on another replica")

    @staticmethod
    def rate_limited(n_tokens: int, rate_per_s: float) -> Rejected:
        """The rejection for a request the token bucket could not serve in time: retry once
        the bucket has refilled `n_tokens` tokens."""
        return Rejected(
            RejectReason.RATE,
            f"over the admission rate of {rate_per_s:g} tokens/s",
            n_tokens / rate_per_s,
        )

    def _time_to_drain(self, excess: int, now: float) -> float:
        """How long until `excess` places free, from the rate at which places were freed.
        Without a recent one, as long as places have been held since one was last taken:
        after a quiet spell that is now (the unknown bound, at least), while places taken
        long ago with none freed since are held by slow requests. Every request leaves by
        its deadline, at most `max_timeout_s` after it entered, so no more than what is left
        of that for the latest one taken (and never more than `max_timeout_s`). O(1): this
        runs for each refusal of a flood."""
        rate = self._places_freed.measured(now)
        if rate is not None and rate > 0:
            return min(excess / rate, self.limits.max_timeout_s)
        taken_at = self._place_taken_at
        held_for = 0.0 if taken_at is None else now - taken_at
        longest = self.limits.max_timeout_s
        if held_for >= longest:  # held past any deadline (a slow reader of a long answer)
            return longest
        return max(RETRY_AFTER_UNKNOWN_S, min(held_for, longest - held_for))
