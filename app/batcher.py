"""The asyncio side of batching: per-model queues, futures, cancellation, and hand-off of
closed batches to the dispatcher (the request path: docs/ARCHITECTURE.md §4).

Everything here runs on the engine's event loop thread; the batch itself runs on a
dispatcher compute thread (the executor the batcher was given: `execute.run_batch` for a
token model, `tensor_batch.run_tensor_batch` for a `tensor` model). Every model's
batcher draws on one shared `ComputeSlots`, so together they never start more batches than
the dispatcher has threads.
Each input's future is resolved exactly once (by its batch, by the scheduler dropping it,
or by its request's answer cancelling it); resolving an already-done future is a no-op. A
batch that fails leaves no input waiting: its rows run again alone (`batch_rerun.py`,
`batch_triage.py`), the rows that compute alone are answered, a row that fails alone fails
as its input's fault once the server was seen computing (until then, the server's), and
when the server fails whatever it runs, every input fails as the server's. A batch that
computes may still hold rows that cannot be answered (`rows_failed`: an embedding's NaN):
those fail as the server's, the rest are answered, and the batch counts toward ill health.
An input that fails withdraws its request's still-queued inputs at once (`_fail`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Generic, TypeVar

from prometheus_client import Histogram

from app.batch_rerun import FailedBatchRerun, Pending, RowsFailed, set_result_if_not_done
from app.batch_trace import ComputedBatch, ItemResult, batch_trace, record_batch_metrics
from app.compute_slots import ComputeSlots
from app.dispatcher import Dispatcher
from app.failures import BatchFailed, DeadlineExceeded
from app.metrics import Metrics
from app.scheduler import Batch, BatchPolicy, BatchShape, Decision, Scheduler, WorkItem
from app.telemetry.shapes import ShapeTracker

log = logging.getLogger(__name__)

T = TypeVar("T")
RowT = TypeVar("RowT")  # one queued input, as the batch's executor takes it
OutT = TypeVar("OutT")  # one input's answer, as the batch's executor gives it


BatchExecutor = Callable[[BatchShape, Sequence[RowT]], ComputedBatch[OutT]]
"""Runs one closed batch (its padded shape, its inputs in order) on a compute thread."""


class Batcher(Generic[RowT, OutT]):
    """One model's queue and batch loop, whatever its inputs are: each queued input (a
    `RowT`) has a length (`length_of`: its tokens, or its longest dynamic dimension), which
    picks its length bucket; `execute` runs a closed batch. Call from the event loop thread
    only (`execute` runs on a compute thread)."""

    def __init__(
        self,
        name: str,
        policy: BatchPolicy,
        execute: BatchExecutor[RowT, OutT],
        length_of: Callable[[RowT], int],
        dispatcher: Dispatcher,
        slots: ComputeSlots,
        metrics: Metrics,
        clock: Callable[[], float],
        on_batch_done: Callable[[BaseException | None], None] = lambda error: None,
        before_batch: Callable[[], None] = lambda: None,
        lost_device_before: Callable[[BaseException], bool] = lambda error: False,
    ) -> None:
        """`before_batch` runs on the compute thread before each batch (a probe's check);
        `lost_device_before(error)`: whether the device was lost by another failure than
        `error` (`BatchHealth.lost_device_before`: a failed batch's answer)."""
        self.name = name
        self._execute_rows = execute
        self._length_of = length_of
        self.shapes = ShapeTracker()
        self._before_batch = before_batch
        self.scheduler = Scheduler(policy)
        self._dispatcher = dispatcher
        self._slots = slots
        self._metrics = metrics
        self._busy = metrics.dispatcher_busy.labels(name)  # charged on compute threads
        self._queue_wait: dict[int, Histogram] = {}  # `metrics.queue_wait`'s, by bucket
        self._on_batch_done = on_batch_done
        self._clock = clock
        # A failed batch's rows are answered from their runs alone, told a failing input
        # from a failing server by the warm-up's rows (`known_good_rows`, once warm-up ran).
        self._rerun: FailedBatchRerun[RowT, OutT] = FailedBatchRerun(
            self.scheduler,
            lambda shape, rows: dispatcher.run_compute(self._run_batch, shape, rows),
            clock,
            self._fail,
            lost_device_before,
            self.rows_failed,
        )
        self._pending: dict[int, Pending[RowT, OutT]] = {}
        self._ids = itertools.count()
        self._wakeup = asyncio.Event()
        slots.listen(self._wakeup)
        self._running_batches = 0
        self._running: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False
        self._next_wake: float | None = None  # when the loop wakes by itself, if it does

    # --- requests -----------------------------------------------------------------------
    def submit(
        self, rows: Sequence[RowT], deadline: float, unit: str = "tokens"
    ) -> list[asyncio.Future[ItemResult[OutT]]]:
        """Queue a request's inputs, all or none; raises `ValueError` (naming the longest
        input's length in `unit`) before queuing any if one fits no bucket."""
        policy = self.scheduler.policy
        lengths = [self._length_of(row) for row in rows]
        buckets = [policy.length_bucket_for(length) for length in lengths]
        if None in buckets:
            raise ValueError(f"{max(lengths)} {unit} exceed the largest length bucket")
        now = self._clock()
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[ItemResult[OutT]]] = [loop.create_future() for _ in rows]
        request_futures = tuple(futures)
        request_items = tuple(next(self._ids) for _ in rows)
        for item_id, row, length, bucket, future in zip(
            request_items, rows, lengths, buckets, futures, strict=True
        ):
            assert bucket is not None
            item = WorkItem(item_id, length, bucket, enqueued_at=now, deadline=deadline)
            future.add_done_callback(partial(self._on_done, item_id))
            self._pending[item_id] = Pending(item, row, future, request_items, request_futures)
            self.scheduler.enqueue(item)
        # With every worker busy the loop only needs waking if these inputs expire before
        # the moment it already waits for: spares a queue scan per arrival under overload.
        expires_at = deadline - max(
            self.scheduler.estimated_compute(BatchShape(1, bucket)) for bucket in buckets if bucket
        )
        if self._slots.free > 0 or self._next_wake is None or expires_at < self._next_wake:
            self._wakeup.set()
        return futures

    def _on_done(self, item_id: int, future: asyncio.Future[ItemResult[OutT]]) -> None:
        if future.cancelled() and item_id in self._pending:
            # The client went away: drop the input before it takes a buffer slot.
            self.scheduler.cancel(item_id)
            self._wakeup.set()

    def _fail(self, pending: Pending[RowT, OutT], error: BaseException) -> None:
        """Fail one input (off `_pending`), which answers its request (`gather_rows`), and
        withdraw the request's queued inputs now: left to that answer, callbacks later, they
        were taken first by the batch loop of Python 3.12 (its `wait_for` resumes sooner).
        Their futures stay for the answer to cancel (cancelled here, one could reach its
        `gather` first and read as the front end's cancel: no answer); those in a batch
        are the batch's, their results unread. Event loop thread only."""
        if pending.future.done():
            return  # cancelled: the request's answer, or its cancel, drops the rest
        pending.future.set_exception(error)
        others = [i for i in pending.request_items if i in self._pending]
        if not others:
            return  # its request's only input, or the rest already answered or batched
        queued = self.scheduler.withdraw(others)
        self._observe_queue_wait(queued, self._clock())
        for item in queued:
            del self._pending[item.item_id]
        if queued:
            self._wakeup.set()  # the loop may stand in line for a batch no longer there

    def rows_failed(self, output: ComputedBatch[OutT]) -> RowsFailed | None:
        """The rows of a batch (or a row run alone) that computed but cannot be answered,
        or None: all can. A subclass checks its outputs (`ModelBatcher`: NaN, infinity)."""
        return None

    # --- the batch loop ---------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._batch_loop(), name=f"batcher-{self.name}")
        self._loop_task.add_done_callback(self._on_loop_exit)

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        """A batch loop that dies of a bug must not leave requests waiting forever: fail
        what is queued (500) and start a fresh loop."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("batch loop of %s failed", self.name, exc_info=task.exception())
        self._fail_queued("batch loop failed")
        if not self._closing:
            self.start()

    def _fail_queued(self, why: str) -> None:
        """Fail every input not yet in a batch (500): after a bug in what closes batches,
        none is known to be in the queue still."""
        self._slots.withdraw(self)
        for item_id, pending in list(self._pending.items()):
            self.scheduler.cancel(item_id)
            if not pending.future.done():
                pending.future.set_exception(BatchFailed(why))

    async def close(self) -> None:
        """Stop after the queue is empty and running batches have finished."""
        self._closing = True
        self._wakeup.set()
        if self._loop_task is not None:
            await self._loop_task

    async def _batch_loop(self) -> None:
        """Close a batch whenever a worker is free and the policy says so; while every
        worker is busy, still answer inputs whose deadline passes (504) and drop cancelled
        ones, so nobody waits on a queue that can no longer serve them."""
        while True:
            self._wakeup.clear()
            now = self._clock()
            wake_at: float | None
            if self._slots.available(self):
                decision = self.scheduler.poll(now)
                wake_at = decision.wake_at
                if decision.batch is None:
                    self._slots.withdraw(self)  # nothing to run yet: the line moves on
            else:
                decision = self.scheduler.expire(now)
                ready_at = self.scheduler.ready_at(now)
                ready = ready_at is not None and ready_at <= now
                self._slots.stand(self, waiting=ready)
                # Not ready yet: wake when it is, to take its place in line then.
                times = (decision.wake_at,) if ready else (decision.wake_at, ready_at)
                wake_at = min((t for t in times if t is not None), default=None)
            self._drop(decision, now)
            if decision.batch is not None:
                self._launch(decision.batch)
                continue
            if self._closing and not self._pending and self._running_batches == 0:
                return
            self._next_wake = wake_at
            timeout = None if wake_at is None else max(0.0, wake_at - now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)

    def _drop(self, decision: Decision, now: float) -> None:
        """Answer the inputs `decision` expired (504) and forget those cancelled; each one's
        wait in the queue ends `now`. Every one leaves `_pending` before any is failed: a
        failure withdraws its request's inputs still pending, and a request's inputs expire
        together; popped one at a time, each failure had `withdraw` look for the request's
        other expired inputs, no longer queued ((k-1) x k ids for a k-input request)."""
        self._observe_queue_wait(decision.expired, now)
        self._observe_queue_wait(decision.cancelled, now)
        expired = [self._pending.pop(item.item_id) for item in decision.expired]
        for item in decision.cancelled:
            self._pending.pop(item.item_id, None)
        for pending in expired:
            self._fail(pending, DeadlineExceeded())

    def _observe_queue_wait(self, items: Sequence[WorkItem], left_at: float) -> None:
        """The queue-wait histogram holds every input's wait until it left the queue: for
        its batch, expired, cancelled (its client gone) or withdrawn with its request; the
        batches' inputs alone hid the waits of overload, which ends mostly in expiries."""
        for item in items:
            histogram = self._queue_wait.get(item.length_bucket)
            if histogram is None:  # labelled once a bucket: an overload expires thousands
                histogram = self._metrics.queue_wait.labels(self.name, str(item.length_bucket))
                self._queue_wait[item.length_bucket] = histogram
            histogram.observe(left_at - item.enqueued_at)

    def _launch(self, batch: Batch) -> None:
        """Take a compute slot and run `batch` in a task of its own."""
        self._slots.take(self)
        self._running_batches += 1
        task = asyncio.create_task(self._execute(batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _launch_ready_batch(self) -> None:
        """Start the next batch now if one is ready and a slot is this model's to take:
        called as a batch's slot comes back, before its answers go out, so the compute
        thread does not idle while the loop sends them (the batch loop, woken by the slot's
        return, does the rest: waiting, the line of models)."""
        if self._slots.available(self):
            now = self._clock()
            decision = self.scheduler.poll(now)
            self._drop(decision, now)
            if decision.batch is not None:
                self._launch(decision.batch)

    async def _execute(self, batch: Batch) -> None:
        pendings = [self._pending.pop(item.item_id) for item in batch.items]
        started = self._clock()
        computed = await self._compute(batch, pendings, started)
        if computed is None:
            return  # it failed: its rows were answered from their runs alone
        output, expected_s, first_seen, unanswerable = computed
        try:
            self._launch_ready_batch()
        except Exception:  # a bug in what the batch loop also runs: its own safety net
            log.exception("starting the next batch of %s failed", self.name)
            self._fail_queued("starting a batch failed")
        try:
            record_batch_metrics(self._metrics, self.name, batch, output)
            trace = batch_trace(batch, output, expected_s, first_seen)
            for row, pending in enumerate(pendings):
                if unanswerable is not None and row in unanswerable.rows:
                    self._fail(pending, unanswerable.error)
                    continue
                set_result_if_not_done(
                    pending.future,
                    ItemResult(
                        value=output.row(row),
                        queue_wait_s=started - pending.item.enqueued_at,
                        compute_s=output.timings.compute_s,
                        batch=trace,
                    ),
                )
        except Exception as error:  # a fault of ours after a good batch: still answer all
            log.exception("answering batch %s of %s failed", batch.shape, self.name)
            for pending in pendings:
                self._fail(pending, BatchFailed(repr(error)))

    async def _compute(
        self, batch: Batch, pendings: list[Pending[RowT, OutT]], started: float
    ) -> tuple[ComputedBatch[OutT], float, bool, RowsFailed | None] | None:
        """Run `batch` on its compute slot, record its compute time for the scheduler's
        estimates, then give the slot back; returns the batch's output, its estimated
        compute, whether its shape was new and its rows that cannot be answered (the batch
        counts as failed when every row is one), or None when it failed (its rows answered
        from their runs alone, on the same slot)."""
        failure: BaseException | None = None
        try:
            self._observe_queue_wait([p.item for p in pendings], started)
            expected_s = self.scheduler.estimated_compute(batch.shape)
            first_seen = self.shapes.first_seen(batch.shape)
            if first_seen:  # whether or not it computes: it is not run a first time again
                self._metrics.unwarmed_shapes.labels(self.name).inc()
            output = await self._dispatcher.run_compute(
                self._run_batch, batch.shape, [p.row for p in pendings]
            )
            # Before the slot goes to the next batch, which is planned on these estimates.
            self.scheduler.record_compute(batch.shape, output.timings.compute_s)
            unanswerable = self.rows_failed(output)
            if unanswerable is not None and len(unanswerable.rows) >= len(pendings):
                failure = unanswerable.error  # every row: the model, not an input (`RowsFailed`)
            return output, expected_s, first_seen, unanswerable
        except Exception as error:
            log.exception("batch %s of %s failed; running its rows alone", batch.shape, self.name)
            failure = await self._rerun.answer(batch, pendings, error, started)
            return None
        except BaseException as error:
            failure = error
            for pending in pendings:
                self._fail(pending, BatchFailed(repr(error)))
            raise
        finally:
            self.scheduler.finished(batch)
            self._running_batches -= 1
            self._slots.give()
            self._on_batch_done(failure)

    def _run_batch(self, shape: BatchShape, rows: Sequence[RowT]) -> ComputedBatch[OutT]:
        """Compute threads only: a batch, or a failed batch's row run alone, its time on the
        thread charged to the busy time as it ends, whether it returned or raised (failure
        storms keep the threads busy too), measured alike for both. Warm-up's runs are not
        charged (`_warm_up_batch`)."""
        self._before_batch()
        started = time.perf_counter()
        try:
            return self._execute_rows(shape, rows)
        finally:
            self._busy.inc(time.perf_counter() - started)

    def _warm_up_batch(self, shape: BatchShape, rows: Sequence[RowT]) -> ComputedBatch[OutT]:
        """Compute threads only."""
        self._before_batch()
        return self._execute_rows(shape, rows)

    # --- warm-up ----------------------------------------------------------------------
    async def warm_up_rows(
        self,
        rows_for_shape: Callable[[BatchShape], Sequence[RowT]],
        on_shape_done: Callable[[int, int], None],
    ) -> None:
        """Run every shape twice on every compute thread (full rows from `rows_for_shape`),
        feeding the scheduler's compute estimates from the second run; `on_shape_done(done,
        total)` reports progress. The first run of a shape is cold (allocations, lazy
        initialisation: ~1.3-2x a later one), and an estimate seeded from it refused or
        expired requests that would have fitted until traffic measured the shape again."""
        self._rerun.known_good_rows = rows_for_shape
        shapes = self.scheduler.policy.shapes()
        for done, shape in enumerate(shapes, start=1):
            rows = rows_for_shape(shape)
            await self._dispatcher.run_on_every_compute_thread(self._warm_up_batch, shape, rows)
            outputs = await self._dispatcher.run_on_every_compute_thread(
                self._warm_up_batch, shape, rows
            )
            for output in outputs:
                self.scheduler.record_compute(shape, output.timings.compute_s)
            self.shapes.mark_warm(shape)
            on_shape_done(done, len(shapes))
