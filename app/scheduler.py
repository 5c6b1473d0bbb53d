"""Pure batching policy: which inputs form the next batch, and when.

No asyncio, no torch, no clock of its own: every call takes `now` (monotonic seconds), so
tests drive it by hand. The asyncio side (`batcher.py`) owns one `Scheduler` per model and
calls it from the event loop thread only.

Rules, in the order they apply on `poll(now)`:

1. Cancelled inputs and inputs that can no longer finish in time (deadline before `now` plus
   the fastest measured compute of their bucket) are dropped before they take a buffer slot.
2. A length bucket is *ready* when its queue holds a full batch, when its oldest input has
   waited `max_wait_s`, or when its most urgent deadline leaves no more time than the
   estimated compute of the batch it would form.
3. Of the ready buckets, the one whose oldest input arrived first goes; its batch takes the
   inputs with the earliest deadlines (FIFO among equal deadlines), padded up to the next
   batch bucket so every batch has one of the preallocated shapes.

Each bucket's queue is a `BucketQueue` (`app/bucket_queue.py`): arrival order and deadlines
in heaps, so a poll or a wake costs O(log n) in queued inputs (and O(rows log n) for the
batch it takes), not the scans it took when n reached `max_queue` under overload.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum

from app.bucket_queue import BucketQueue


class CloseReason(Enum):
    FULL = "full"
    MAX_WAIT = "max_wait"
    DEADLINE = "deadline"


@dataclass(frozen=True, slots=True)
class BatchShape:
    """A padded (batch rows x token length) shape; the key of a buffer-pool slot."""

    batch: int
    length: int


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One input waiting for a batch. `deadline` and `enqueued_at` are monotonic seconds."""

    item_id: int
    n_tokens: int
    length_bucket: int
    enqueued_at: float
    deadline: float


@dataclass(frozen=True, slots=True)
class Batch:
    shape: BatchShape
    items: tuple[WorkItem, ...]
    reason: CloseReason


@dataclass(frozen=True, slots=True)
class Decision:
    """What `poll` decided: a batch to run now (or None), what it dropped, when to ask again."""

    batch: Batch | None
    expired: tuple[WorkItem, ...] = ()
    cancelled: tuple[WorkItem, ...] = ()
    wake_at: float | None = None


@functools.lru_cache(maxsize=1024)  # asked several times per poll, of a few buckets
def batch_buckets(
    max_batch_size: int, max_batch_tokens: int, length_bucket: int
) -> tuple[int, ...]:
    """Batch sizes 1, 2, 4, ... for one length bucket, capped by rows and by rows x length."""
    cap = max(1, min(max_batch_size, max_batch_tokens // length_bucket))
    sizes = [1]
    while sizes[-1] * 2 <= cap:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != cap:
        sizes.append(cap)
    return tuple(sizes)


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    length_buckets: tuple[int, ...]
    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float

    def __post_init__(self) -> None:
        if not self.length_buckets or list(self.length_buckets) != sorted(set(self.length_buckets)):
            raise ValueError("length_buckets must be non-empty and strictly increasing")

    def length_bucket_for(self, n_tokens: int) -> int | None:
        """The smallest length bucket holding `n_tokens`, or None when none does."""
        index = bisect.bisect_left(self.length_buckets, n_tokens)
        return self.length_buckets[index] if index < len(self.length_buckets) else None

    def batch_buckets(self, length_bucket: int) -> tuple[int, ...]:
        return batch_buckets(self.max_batch_size, self.max_batch_tokens, length_bucket)

    def max_batch(self, length_bucket: int) -> int:
        return self.batch_buckets(length_bucket)[-1]

    def padded_batch(self, length_bucket: int, rows: int) -> int:
        buckets = self.batch_buckets(length_bucket)
        return buckets[bisect.bisect_left(buckets, rows)]

    def shapes(self) -> tuple[BatchShape, ...]:
        """Every shape a batch can take: what the buffer pool preallocates and warm-up runs."""
        return tuple(
            BatchShape(batch=rows, length=length)
            for length in self.length_buckets
            for rows in self.batch_buckets(length)
        )


@dataclass(slots=True)
class _ComputeEstimate:
    """Exponentially weighted mean of measured batch compute seconds, per shape."""

    by_shape: dict[BatchShape, float] = field(default_factory=dict)
    weight: float = 0.2

    def record(self, shape: BatchShape, seconds: float) -> None:
        previous = self.by_shape.get(shape)
        self.by_shape[shape] = (
            seconds if previous is None else previous + self.weight * (seconds - previous)
        )

    def get(self, shape: BatchShape) -> float:
        return self.by_shape.get(shape, 0.0)


class Scheduler:
    """Per-model queues by length bucket and the policy that closes batches.

    Not thread-safe: the event loop thread alone calls it.
    """

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._queues: dict[int, BucketQueue] = {b: BucketQueue() for b in policy.length_buckets}
        self._bucket_of: dict[int, int] = {}  # a queued input's id -> its length bucket
        self._cancelled: set[int] = set()  # ids `cancel` was told, until the next drop
        self._depth = 0
        self._compute = _ComputeEstimate()
        # Batches handed out by `poll` and not yet `finished`: when each should end, by its
        # first input's id (an input is in one batch only).
        self._running_until: dict[int, float] = {}

    @property
    def depth(self) -> int:
        """Inputs queued, cancelled ones included until the next `poll` drops them."""
        return self._depth

    def enqueue(self, item: WorkItem) -> None:
        """Queue an input. Inputs come in order of `enqueued_at` (the batcher's monotonic
        clock), which is their arrival order (an earlier stamp goes before, by its stamp);
        an id can be queued once at a time."""
        queue = self._queues.get(item.length_bucket)
        if queue is None:
            raise ValueError(f"no length bucket {item.length_bucket}")
        if item.item_id in self._bucket_of:
            raise ValueError(f"input {item.item_id} is queued already")
        queue.push(item)
        self._bucket_of[item.item_id] = item.length_bucket
        self._depth += 1

    def cancel(self, item_id: int) -> None:
        """Mark an input as abandoned; the next `poll` drops it if it is still queued."""
        self._cancelled.add(item_id)

    def withdraw(self, item_ids: Collection[int]) -> tuple[WorkItem, ...]:
        """Take those of `item_ids` still queued out of the queue now (cancelled ones too)
        and return them: nothing answers them here, the caller does (the batcher withdraws
        a request's queued inputs when another one's failure answered the request). An
        input `poll` already handed out in a batch (running or about to) is not queued and
        stays its batch's; unknown and dropped ids are ignored. `depth` counts at once.
        No ids, no work: nothing is scanned (every expiry of a one-input request asks).
        They come back by bucket, then in arrival order. Only the buckets holding some of
        them are touched, O(log n) each (`BucketQueue`); none queued, no work."""
        if not item_ids:
            return ()
        by_bucket: dict[int, list[int]] = {}
        for item_id in set(item_ids):
            length = self._bucket_of.get(item_id)
            if length is not None:
                by_bucket.setdefault(length, []).append(item_id)
        if not by_bucket:
            return ()
        withdrawn = [
            item for length in sorted(by_bucket) for item in self._take_out(length, by_bucket)
        ]
        self._depth -= len(withdrawn)
        self._cancelled.difference_update(item.item_id for item in withdrawn)
        return tuple(withdrawn)

    def _take_out(self, length: int, by_bucket: dict[int, list[int]]) -> list[WorkItem]:
        """Take this bucket's ids of `by_bucket` out of its queue; those it held, in
        arrival order."""
        removed = self._queues[length].remove(by_bucket[length])
        for item in removed:
            del self._bucket_of[item.item_id]
        return removed

    def record_compute(self, shape: BatchShape, seconds: float) -> None:
        """Feed back a measured batch time (warm-up measures every shape before traffic)."""
        self._compute.record(shape, seconds)

    def estimated_compute(self, shape: BatchShape) -> float:
        return self._compute.get(shape)

    def seconds_per_input(self, length_bucket: int) -> float:
        """Compute one queued input of this bucket costs when batches are full (measured)."""
        rows, seconds = self.full_batch(length_bucket)
        return seconds / rows

    def backlog_seconds(self, now: float) -> float:
        """The compute a new input waits behind, on one worker (the caller divides among
        workers): `running_seconds` and `queued_seconds`.

        Counting the running batches is what keeps an admitted request's wait within the
        delay budget under overload: without them the budget let a request wait up to a
        whole batch longer than it said."""
        return self.running_seconds(now) + self.queued_seconds()

    def running_seconds(self, now: float) -> float:
        """What is left of the running batches: their estimated compute from when they
        started, or as `runs_until` moved their end; at least 0 each."""
        return sum(max(0.0, until - now) for until in self._running_until.values())

    def queued_seconds(self) -> float:
        """Everything queued, run in full batches."""
        return sum(
            len(queue) * self.seconds_per_input(length) for length, queue in self._queues.items()
        )

    def queued(self, length_bucket: int) -> int:
        """Inputs queued in one length bucket (cancelled ones until the next `poll`)."""
        return len(self._queues[length_bucket])

    def full_batch(self, length_bucket: int) -> tuple[int, float]:
        """A full batch of this bucket: its rows and its measured compute seconds."""
        rows = self.policy.max_batch(length_bucket)
        return rows, self._compute.get(BatchShape(rows, length_bucket))

    def runs_until(self, batch: Batch, until: float) -> None:
        """A batch `poll` handed out, still running, now ends at `until`, not at its
        estimate from when it started: a failed batch run again row by row (a known-good
        row, then each row alone: `batch_triage`), on its compute slot all along, which
        `backlog_seconds` read as free once the batch's own estimate ran out, so admission
        let in requests that waited behind the triage and ended 504. The caller keeps it
        current as the runs go. A batch already `finished` is left so."""
        key = batch.items[0].item_id
        if key in self._running_until:
            self._running_until[key] = until

    def finished(self, batch: Batch) -> None:
        """A batch `poll` handed out has ended (computed or failed): its remaining compute
        leaves the backlog."""
        self._running_until.pop(batch.items[0].item_id, None)

    def expire(self, now: float) -> Decision:
        """Call while every worker is busy: drops cancelled and hopeless inputs only, and
        says when the next queued input will become hopeless."""
        expired, cancelled = self._drop_dead(now)
        wake_at = min(
            (
                queue.earliest_deadline() - self._compute.get(BatchShape(1, length))
                for length, queue in self._queues.items()
                if queue
            ),
            default=None,
        )
        return Decision(batch=None, expired=expired, cancelled=cancelled, wake_at=wake_at)

    def ready_at(self, now: float) -> float | None:
        """When `poll` will close a batch (`now` or earlier: it would now); None with
        nothing queued. A batcher whose batch is ready and no compute slot free claims the
        next one (`ComputeSlots`), so it wants to wake then too."""
        return min(
            (
                self._readiness(length, queue, now)[1]
                for length, queue in self._queues.items()
                if queue
            ),
            default=None,
        )

    def poll(self, now: float) -> Decision:
        """Call when a dispatcher worker is free: returns the batch to run now, if any; the
        caller reports its end with `finished`."""
        expired, cancelled = self._drop_dead(now)
        best: tuple[float, int, CloseReason] | None = None
        wake_at: float | None = None
        for length, queue in self._queues.items():
            if not queue:
                continue
            reason, ready_at = self._readiness(length, queue, now)
            if reason is not None:
                oldest = queue.oldest().enqueued_at
                if best is None or oldest < best[0]:
                    best = (oldest, length, reason)
            elif wake_at is None or ready_at < wake_at:
                wake_at = ready_at
        batch = None
        if best is not None:
            batch = self._take(best[1], best[2], now)
        if batch is not None:
            self._running_until[batch.items[0].item_id] = now + self.estimated_compute(batch.shape)
        return Decision(
            batch=batch,
            expired=expired,
            cancelled=cancelled,
            wake_at=None if batch is not None else wake_at,
        )

    def _readiness(
        self, length: int, queue: BucketQueue, now: float
    ) -> tuple[CloseReason | None, float]:
        """Why this bucket's batch should close now, or else the time it will have to."""
        rows = min(len(queue), self.policy.max_batch(length))
        if len(queue) >= self.policy.max_batch(length):
            return CloseReason.FULL, now
        max_wait_at = queue.oldest().enqueued_at + self.policy.max_wait_s
        if now >= max_wait_at:
            return CloseReason.MAX_WAIT, now
        shape = BatchShape(self.policy.padded_batch(length, rows), length)
        urgent_at = queue.earliest_deadline() - self._compute.get(shape)
        if now >= urgent_at:
            return CloseReason.DEADLINE, now
        return None, min(max_wait_at, urgent_at)

    def _take(self, length: int, reason: CloseReason, now: float) -> Batch:
        """The batch this bucket closes now, small enough for its most urgent input."""
        queue = self._queues[length]
        rows = min(len(queue), self.policy.max_batch(length))
        if rows == len(queue):
            chosen = queue.take_all()  # in arrival order
        else:
            # Earliest deadlines first, equal deadlines in arrival order; then by arrival
            # time (`sort` is stable: equal ones stay in deadline order).
            chosen = queue.pop_earliest(rows)
            chosen.sort(key=lambda item: item.enqueued_at)
        for item in chosen:
            del self._bucket_of[item.item_id]
        self._depth -= rows
        # A larger batch computes slower than the one input `_drop_dead` judges by: while
        # the most urgent input would finish after its deadline in this batch, the latest
        # deadline goes back to the queue (it fits a later batch), so the batch shrinks
        # until the urgent one makes it. One input alone always does (`_drop_dead` kept only
        # those). Shedding the urgent one instead answered 504 to the very input a DEADLINE
        # close was for, whenever the loop woke a hair late, while the relaxed ones ran.
        first = min(chosen, key=lambda i: i.deadline)
        put_back: list[WorkItem] = []
        while True:
            shape = BatchShape(self.policy.padded_batch(length, len(chosen)), length)
            if len(chosen) == 1 or first.deadline >= now + self._compute.get(shape):
                break
            latest = max((i for i in chosen if i is not first), key=lambda i: i.deadline)
            chosen.remove(latest)
            put_back.append(latest)
        for item in put_back:  # after the queued inputs of its `enqueued_at`, in this order
            queue.push(item)
            self._bucket_of[item.item_id] = length
        self._depth += len(put_back)
        return Batch(shape=shape, items=tuple(chosen), reason=reason)

    def _drop_dead(self, now: float) -> tuple[tuple[WorkItem, ...], tuple[WorkItem, ...]]:
        """Take out the cancelled inputs, then those that can no longer finish in time:
        each by bucket, then in arrival order. O(log n) per input dropped, and per bucket
        O(1) when none is (its earliest deadline says so)."""
        gone: dict[int, list[int]] = {}
        for item_id in self._cancelled:
            length = self._bucket_of.get(item_id)
            if length is not None:
                gone.setdefault(length, []).append(item_id)
        self._cancelled.clear()
        expired: list[WorkItem] = []
        cancelled: list[WorkItem] = []
        for length, queue in self._queues.items():
            if length in gone:
                cancelled.extend(self._take_out(length, gone))
            if not queue:
                continue
            fastest = self._compute.get(BatchShape(1, length))
            for item in queue.pop_due(now + fastest):
                del self._bucket_of[item.item_id]
                expired.append(item)
        self._depth -= len(expired) + len(cancelled)
        return tuple(expired), tuple(cancelled)
