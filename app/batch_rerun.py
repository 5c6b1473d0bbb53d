"""A failed batch's rows answered from their runs alone (`batch_triage` decides whose
fault each failure is), on the failed batch's compute slot, and what it and the batcher
share: the record of one queued input (`Pending`), and the rows of a computed batch that
cannot be answered (`RowsFailed`).

Event loop thread only; the runs themselves go to a compute thread through `run`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from app.batch_trace import ComputedBatch, ItemResult, batch_trace
from app.batch_triage import RowFailed, triage
from app.failures import BatchFailed, DeadlineExceeded, DeviceLost, InputFailed, device_lost
from app.scheduler import Batch, BatchShape, Scheduler, WorkItem

T = TypeVar("T")
RowT = TypeVar("RowT")  # one queued input, as the batch's executor takes it
OutT = TypeVar("OutT")  # one input's answer, as the batch's executor gives it

# What a row of a failed batch too late for its run alone is told (not "in the queue": it
# had left the queue for the batch that failed).
RERUN_DEADLINE_PASSED = "deadline passed while its batch, which failed, was run again row by row"


@dataclass(frozen=True, slots=True)
class Pending(Generic[RowT, OutT]):
    item: WorkItem
    row: RowT
    future: asyncio.Future[ItemResult[OutT]]
    request_items: tuple[int, ...]  # the item ids of its request's inputs, its own included
    request_futures: tuple[asyncio.Future[ItemResult[OutT]], ...]  # in the same order


@dataclass(frozen=True, slots=True)
class RowsFailed:
    """The rows of a batch that computed whose outputs cannot be answered (an embedding
    holding a NaN or an infinity: `ModelBatcher.rows_failed`): each fails with `error`, a
    fault of the server's (500); the batch's other rows are answered. The batch counts
    toward the model's ill health, as one that raised, only when every row of it failed so:
    a model computing NaN for every input is broken, one input that overflows is not, and a
    client resending it must not turn /healthz unhealthy."""

    rows: frozenset[int]
    error: Exception


def set_result_if_not_done(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


class FailedBatchRerun(Generic[RowT, OutT]):
    """Answers the rows of failed batches from their runs alone. `run(shape, rows)`
    computes rows on a compute thread (raising what the model raised); `known_good_rows`
    gives rows the model computes (the warm-up's), None before warm-up; `fail(pending,
    error)` fails one input and withdraws its request's queued inputs (`Batcher._fail`);
    `lost_device_before(error)`: whether the device was lost by another batch's failure
    than `error` (`BatchHealth.lost_device_before`); `rows_failed(output)` says which
    rows of a run that computed cannot be answered (`Batcher.rows_failed`). Event loop
    thread only."""

    def __init__(
        self,
        scheduler: Scheduler,
        run: Callable[[BatchShape, Sequence[RowT]], Awaitable[ComputedBatch[OutT]]],
        clock: Callable[[], float],
        fail: Callable[[Pending[RowT, OutT], BaseException], None],
        lost_device_before: Callable[[BaseException], bool] = lambda error: False,
        rows_failed: Callable[[ComputedBatch[OutT]], RowsFailed | None] = lambda output: None,
    ) -> None:
        self.scheduler = scheduler
        self._run = run
        self._clock = clock
        self._fail = fail
        self._lost_device_before = lost_device_before
        self._rows_failed = rows_failed
        self.known_good_rows: Callable[[BatchShape], Sequence[RowT]] | None = None

    async def answer(
        self,
        batch: Batch,
        pendings: list[Pending[RowT, OutT]],
        error: Exception,
        started: float,
    ) -> Exception | None:
        """Answer each row of a failed batch from its run alone (`batch_triage`), in the
        smallest batch of its length (a full-size padded batch per row cost as many full
        batches as rows); returns the failure to count against the engine's health, None
        only when triage saw the server compute (its known-good row, or a row alone) and
        inputs alone were at fault: a failed batch where nothing computed never clears
        health's count. Out of memory and a lost device are the server's, for the batch and
        for a row alone (`batch_triage.server_fault`: a transient one would otherwise read
        as the input's fault), and so is a fault of the triage itself, and a row whose run
        alone computed an output that cannot be answered (`rows_failed`); the rows of a
        batch whose failure lost the device fail `DeviceLost` (before health hears of the
        loss, which exits the engine once they are answered). A row of its input's
        fault is failed as soon as triage is sure of it (`on_input_fault`), so its
        request's other rows are not run alone for nobody (`_still_waiting`).
        A row answered waited in the queue until the failed batch `started`; all its time
        since was spent computing, its own run alone and the rest lost to the failed batch
        (the batch's run, the triage's other runs: `BatchTrace.failed_batch_s`).
        The triage holds the batch's compute slot: the scheduler hears of the runs it may
        still make, each at a row's estimated compute alone, before the first and as each
        ends or is skipped (`Scheduler.runs_until`), so the backlog admission reads counts
        them."""
        length = batch.shape.length
        solo = BatchShape(self.scheduler.policy.padded_batch(length, 1), length)
        solo_s = self.scheduler.estimated_compute(solo)
        waiting = [p for p in pendings if not p.future.done()]  # not those gone or expired
        runs_left = len(waiting)

        def run_done() -> None:
            nonlocal runs_left
            runs_left -= 1
            self.scheduler.runs_until(batch, self._clock() + runs_left * solo_s)

        async def run_alone(rows: Sequence[RowT]) -> ComputedBatch[OutT]:
            try:
                return await self._run(solo, rows)
            finally:
                run_done()

        def still_waiting(index: int) -> bool:
            if self._still_waiting(waiting[index], solo):
                return True
            run_done()  # not run
            return False

        try:
            known_good = self.known_good_rows(solo)[:1] if self.known_good_rows else None
            if known_good is not None:
                runs_left += 1
            self.scheduler.runs_until(batch, self._clock() + runs_left * solo_s)
            verdict = await triage(
                [p.row for p in waiting],
                error,
                run_alone,
                known_good,
                still_waiting=still_waiting,
                on_input_fault=lambda index, failed: self._fail_row(waiting[index], failed),
            )
        except BaseException as fault:
            for pending in pendings:
                self._fail(pending, BatchFailed(repr(fault)))
            if isinstance(fault, Exception):
                return fault
            raise
        # A lost device: the rows' answer says whether this batch's failure lost it.
        first: bool | None = None
        if (lost := verdict.server_error) is not None and device_lost(lost):
            first = not self._lost_device_before(lost)
        # A row alone computing a NaN counts against health only if no row alone computed
        # an answer: one client's input that overflows must not make the pod unhealthy.
        non_finite: Exception | None = None
        answered = False
        for pending, alone in zip(waiting, verdict.alone, strict=True):
            if alone is None:
                continue  # answered already, or nobody waits for it
            if isinstance(alone, RowFailed):
                self._fail_row(pending, alone, first)  # a no-op for one failed already
                continue
            if (unanswerable := self._rows_failed(alone)) is not None:
                self._fail(pending, unanswerable.error)
                non_finite = unanswerable.error
                continue
            answered = True
            own_s = alone.timings.compute_s
            since_started = self._clock() - started
            set_result_if_not_done(
                pending.future,
                ItemResult(
                    value=alone.row(0),
                    queue_wait_s=started - pending.item.enqueued_at,
                    compute_s=since_started,
                    batch=batch_trace(
                        batch, alone, own_s, False, failed_batch_s=max(0.0, since_started - own_s)
                    ),
                ),
            )
        if verdict.server_error is None and not answered:
            return non_finite
        return verdict.server_error

    def _fail_row(
        self, pending: Pending[RowT, OutT], failed: RowFailed, lost_first: bool | None = None
    ) -> None:
        """Fail a row of a failed batch as triage found it: 500 when the server's, else 400
        (`InputFailed`); a no-op for a row already answered. `lost_first`, when the batch
        failed of a lost device: whether its failure is the one that lost it (`DeviceLost`).
        Event loop thread only."""
        failure: Exception
        if lost_first is not None and failed.servers:
            failure = DeviceLost(first=lost_first)
        else:
            failure = (BatchFailed if failed.servers else InputFailed)(repr(failed.error))
        failure.__cause__ = failed.error  # its traceback, for whoever answers it
        self._fail(pending, failure)

    def _still_waiting(self, pending: Pending[RowT, OutT], solo: BatchShape) -> bool:
        """Whether a row of a failed batch is still worth its run alone, asked just before
        it: not once an input of its request, itself included, failed or was cancelled
        (its client left, or the request is answered with that failure, the rest unread:
        checked here, as the answer's task may not have run yet to cancel them), nor once
        it can no longer finish in time (its deadline before now plus the run's estimated
        compute, the scheduler's rule for queued inputs): that one is answered 504 now, its
        request's queued inputs withdrawn with it (`_fail`). A row in a batch is off the
        scheduler, so nothing else expires it. Event loop thread only."""
        if pending.future.done() or any(
            future.cancelled() or (future.done() and future.exception() is not None)
            for future in pending.request_futures
        ):
            return False
        if pending.item.deadline <= self._clock() + self.scheduler.estimated_compute(solo):
            self._fail(pending, DeadlineExceeded(RERUN_DEADLINE_PASSED))
            return False
        return True
