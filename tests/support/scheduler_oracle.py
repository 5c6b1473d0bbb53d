"""The oracle of the old scheduler: `Scheduler` as it was before its queues became heaps
(app/scheduler.py at commit 0d25822, its O(n) scans per batch and per wake included), kept
frozen and never shipped. tests/unit/test_scheduler_differential.py drives it and the
shipped `app.scheduler.Scheduler` through the same random sequences and asserts they decide
alike. Do not fix or tidy it: it is the reference as it was."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from app.scheduler import (
    Batch,
    BatchPolicy,
    BatchShape,
    CloseReason,
    Decision,
    WorkItem,
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


class OracleScheduler:
    """The scheduler as it was before its queues became heaps (app/scheduler.py at 0d25822),
    frozen: the oracle `tests/unit/test_scheduler_differential.py` checks the shipped one
    against. Per-model queues by length bucket and the policy that closes batches.

    Not thread-safe: the event loop thread alone calls it.
    """

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._queues: dict[int, deque[WorkItem]] = {b: deque() for b in policy.length_buckets}
        self._cancelled: set[int] = set()
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
        if item.length_bucket not in self._queues:
            raise ValueError(f"no length bucket {item.length_bucket}")
        self._queues[item.length_bucket].append(item)
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
        No ids, no work: nothing is scanned (every expiry of a one-input request asks)."""
        if not item_ids:
            return ()
        wanted = set(item_ids)
        withdrawn: list[WorkItem] = []
        for length, queue in self._queues.items():
            if not any(item.item_id in wanted for item in queue):
                continue
            keep: deque[WorkItem] = deque()
            for item in queue:
                (withdrawn if item.item_id in wanted else keep).append(item)
            self._queues[length] = keep
        self._depth -= len(withdrawn)
        self._cancelled.difference_update(item.item_id for item in withdrawn)
        return tuple(withdrawn)

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
        workers): what is left of the running batches (their estimated compute from when
        they started, or as `runs_until` moved their end; at least 0) and everything
        queued, run in full batches.

        Counting the running batches is what keeps an admitted request's wait within the
        delay budget under overload: without them the budget let a request wait up to a
        whole batch longer than it said."""
        running = sum(max(0.0, until - now) for until in self._running_until.values())
        return running + sum(
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
                item.deadline - self._compute.get(BatchShape(1, length))
                for length, queue in self._queues.items()
                for item in queue
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
                oldest = queue[0].enqueued_at
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
        self, length: int, queue: deque[WorkItem], now: float
    ) -> tuple[CloseReason | None, float]:
        """Why this bucket's batch should close now, or else the time it will have to."""
        rows = min(len(queue), self.policy.max_batch(length))
        if len(queue) >= self.policy.max_batch(length):
            return CloseReason.FULL, now
        max_wait_at = queue[0].enqueued_at + self.policy.max_wait_s
        if now >= max_wait_at:
            return CloseReason.MAX_WAIT, now
        shape = BatchShape(self.policy.padded_batch(length, rows), length)
        urgent_at = min(item.deadline for item in queue) - self._compute.get(shape)
        if now >= urgent_at:
            return CloseReason.DEADLINE, now
        return None, min(max_wait_at, urgent_at)

    def _take(self, length: int, reason: CloseReason, now: float) -> Batch:
        """The batch this bucket closes now, small enough for its most urgent input."""
        queue = self._queues[length]
        rows = min(len(queue), self.policy.max_batch(length))
        if rows == len(queue):
            chosen = list(queue)
            queue.clear()
        else:
            # Earliest deadlines first; `sorted` is stable, so equal deadlines stay FIFO.
            by_deadline = sorted(queue, key=lambda item: item.deadline)
            chosen = by_deadline[:rows]
            chosen_ids = {item.item_id for item in chosen}
            self._queues[length] = deque(i for i in queue if i.item_id not in chosen_ids)
            chosen.sort(key=lambda item: item.enqueued_at)
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
        if put_back:
            back = sorted([*self._queues[length], *put_back], key=lambda i: i.enqueued_at)
            self._queues[length] = deque(back)
            self._depth += len(put_back)
        return Batch(shape=shape, items=tuple(chosen), reason=reason)

    def _drop_dead(self, now: float) -> tuple[tuple[WorkItem, ...], tuple[WorkItem, ...]]:
        expired: list[WorkItem] = []
        cancelled: list[WorkItem] = []
        for length, queue in self._queues.items():
            fastest = self._compute.get(BatchShape(1, length))
            if not self._cancelled and all(i.deadline > now + fastest for i in queue):
                continue
            keep: deque[WorkItem] = deque()
            for item in queue:
                if item.item_id in self._cancelled:
                    cancelled.append(item)
                elif item.deadline <= now + fastest:
                    expired.append(item)
                else:
                    keep.append(item)
            self._queues[length] = keep
        self._depth -= len(expired) + len(cancelled)
        self._cancelled.clear()
        return tuple(expired), tuple(cancelled)
