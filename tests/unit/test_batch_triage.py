"""Telling a failing input from a failing server, over a fake model that throws on some
rows (the point here is the verdict, not the compute); and how the batcher accounts the time
of a row answered after its batch failed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from app.batch_triage import triage
from app.batcher import Batcher
from app.compute_slots import ComputeSlots
from app.execute import SlotTimings
from app.failures import InputFailed
from app.metrics import Metrics
from app.scheduler import BatchPolicy, BatchShape

BAD = -1


def model(broken: bool = False):  # type: ignore[no-untyped-def]
    """Doubles each row; throws on a BAD row, or on every row when `broken`."""

    async def run(rows: Sequence[int]) -> list[int]:
        if broken or BAD in rows:
            raise IndexError("index out of range")
        return [2 * row for row in rows]

    return run


async def test_the_good_rows_of_a_failed_batch_are_answered_and_the_bad_one_is_its_own() -> None:
    verdict = await triage([1, BAD, 3], IndexError("batch"), model(), known_good=[0], batch_rows=3)
    assert verdict.alone[0] == [2] and verdict.alone[2] == [6]
    assert isinstance(verdict.alone[1], IndexError)
    assert not verdict.server_failing


@pytest.mark.parametrize("rows", [[BAD], [BAD, BAD]])
async def test_when_no_row_computes_a_known_good_row_decides(rows: list[int]) -> None:
    verdict = await triage(rows, IndexError("batch"), model(), known_good=[0], batch_rows=len(rows))
    assert all(isinstance(result, IndexError) for result in verdict.alone)
    assert not verdict.server_failing  # the known-good row computes: the inputs are at fault
    broken = await triage(
        rows, IndexError("batch"), model(broken=True), known_good=[0], batch_rows=len(rows)
    )
    assert broken.server_failing


async def test_a_failing_server_is_found_with_one_run_not_one_per_row() -> None:
    """A device that fell over fails every row, each failure as slow as the batch's:
    running each row again held the compute slot for as many batches as rows."""
    runs: list[Sequence[int]] = []
    broken = model(broken=True)

    async def counted(rows: Sequence[int]) -> list[int]:
        runs.append(rows)
        return await broken(rows)

    verdict = await triage([1, 2, 3, 4], IndexError("batch"), counted, known_good=[0], batch_rows=4)
    assert verdict.server_failing and runs == [[0]]


async def test_without_a_known_good_row_a_batch_where_nothing_computes_is_the_server_s() -> None:
    verdict = await triage([BAD, BAD], IndexError("batch"), model(), known_good=None, batch_rows=2)
    assert verdict.server_failing


async def test_a_batch_of_one_row_is_not_run_again() -> None:
    runs: list[Sequence[int]] = []
    inner = model()

    async def counted(rows: Sequence[int]) -> list[int]:
        runs.append(rows)
        return await inner(rows)

    batch_error = IndexError("batch")
    verdict = await triage([BAD], batch_error, counted, known_good=[0], batch_rows=1)
    assert verdict.alone == [batch_error] and runs == [[0]]  # the known-good row only


@pytest.mark.parametrize("known_good", [[0], None])
async def test_a_row_left_alone_by_the_others_going_runs_alone_before_it_is_blamed(
    known_good: list[int] | None,
) -> None:
    """The bad row's request was cancelled (or expired) while the batch ran: the one row
    still waiting is not the batch of one that failed, and must not get its error (400, or
    500 and ill health without a known-good row)."""
    verdict = await triage([1], IndexError("batch"), model(), known_good, batch_rows=2)
    assert verdict.alone == [[2]] and not verdict.server_failing


async def test_a_failed_batch_whose_rows_all_went_says_nothing_of_the_server() -> None:
    verdict = await triage([], IndexError("batch"), model(), known_good=None, batch_rows=2)
    assert verdict.alone == [] and not verdict.server_failing


async def test_a_row_answered_after_its_batch_failed_spent_that_batch_computing() -> None:
    """The failed batch's 200 ms (and the triage's run of the other row) was counted as
    the row's queue wait: its slow-request report blamed queueing on an idle queue."""
    now = [100.0]

    @dataclass(frozen=True)
    class Computed:
        rows: Sequence[int]
        timings: SlotTimings

        def row(self, index: int) -> int:
            return 2 * self.rows[index]

    def execute(shape: BatchShape, rows: Sequence[int]) -> Computed:
        seconds = 0.2 if len(rows) > 1 else 0.01
        now[0] += seconds  # the compute thread's time passes on the injected clock
        if len(rows) > 1 or BAD + 10 in rows:
            raise IndexError("index out of range")
        return Computed(rows, SlotTimings(compute_s=seconds, acquire_wait_s=0.0, pool_miss=False))

    class InlineDispatcher:
        async def run_compute(self, fn, *args):  # type: ignore[no-untyped-def]
            return fn(*args)

    batcher: Batcher[int, int] = Batcher(
        "m",
        BatchPolicy(length_buckets=(16,), max_batch_size=4, max_batch_tokens=64, max_wait_s=0.0),
        execute,
        length_of=lambda row: row,
        dispatcher=InlineDispatcher(),  # type: ignore[arg-type]
        slots=ComputeSlots(1),
        metrics=Metrics(),
        clock=lambda: now[0],
    )
    good, bad = batcher.submit([5, BAD + 10], deadline=now[0] + 10)
    batcher.start()
    answered = await asyncio.wait_for(good, timeout=10)
    with pytest.raises(InputFailed) as failed:
        await bad
    # What the model raised, traceback and all, for the engine's log (never the client's).
    assert isinstance(failed.value.__cause__, IndexError)
    assert failed.value.__cause__.__traceback__ is not None
    await batcher.close()
    assert answered.value == 10
    assert answered.queue_wait_s == pytest.approx(0.0)  # its batch started at once
    # The failed batch, the bad row's run alone, its own: all compute.
    assert answered.compute_s == pytest.approx(0.22)
    assert answered.batch is not None
    assert answered.batch.failed_batch_s == pytest.approx(0.21)
