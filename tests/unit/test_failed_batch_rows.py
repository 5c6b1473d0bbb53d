"""What the batcher answers each row of a failed batch, over an inline fake dispatcher (a
batch runs on the event loop) and a clock the fake model moves (each run takes 1 s), so the
order is deterministic with no sleeps: a failure of the server's (out of memory, a lost
device) is answered 500 and counts toward ill health, whether the batch hit it or a row
alone; a row nobody waits for any more is not run alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

import pytest

from app.batch_rerun import RERUN_DEADLINE_PASSED
from app.batch_trace import ItemResult
from app.batcher import Batcher
from app.compute_slots import ComputeSlots
from app.engine.health import BatchHealth
from app.engine.protocol import EmbedPayload, FailureKind, FromEngine, Submit
from app.engine.rows import gather_rows
from app.execute import SlotTimings
from app.failures import BatchFailed, DeadlineExceeded, InputFailed
from app.metrics import Metrics
from app.scheduler import BatchPolicy, BatchShape, Scheduler
from tests.support.inline_batching import Computed, InlineDispatcher

T = TypeVar("T")
BAD, HEAVY = 3, 7  # a row the model throws on; one the server fails on alone
LONG = 12  # a row of the 16 length bucket (a row is its own length)
RUN_S = 1.0

TWO_BUCKETS = BatchPolicy(
    length_buckets=(8, 16), max_batch_size=4, max_batch_tokens=64, max_wait_s=0
)


class OutOfMemoryError(RuntimeError):
    """Named as torch's (`torch.OutOfMemoryError`)."""


class Model:
    """Doubles rows, each run moving the clock `RUN_S`; throws an IndexError on a batch
    holding a BAD row, `heavy_fault` on a HEAVY row alone, `batch_fault` (when set) on any
    batch of more than one row, `next_fault` (when set) on the next run only.
    `on_known_good` runs when the known-good row (0) does, `on_batch` when a batch of more
    than one row does."""

    def __init__(self, heavy_fault: Exception | None = None) -> None:
        self.now = 0.0
        self.ran: list[list[int]] = []
        self.heavy_fault = heavy_fault
        self.batch_fault: Exception | None = None
        self.next_fault: Exception | None = None
        self.on_known_good: Callable[[], None] = lambda: None
        self.on_batch: Callable[[], None] = lambda: None

    def clock(self) -> float:
        return self.now

    def __call__(self, shape: BatchShape, rows: Sequence[int]) -> Computed:
        self.ran.append(list(rows))
        self.now += RUN_S
        if list(rows) == [0]:
            self.on_known_good()
        if len(rows) > 1:
            self.on_batch()
        if self.next_fault is not None:
            fault, self.next_fault = self.next_fault, None
            raise fault
        if self.batch_fault is not None and len(rows) > 1:
            raise self.batch_fault
        if BAD in rows:
            raise IndexError("index out of range")
        if rows == [HEAVY] and self.heavy_fault is not None:
            raise self.heavy_fault
        return Computed(rows)


def cold_batcher(model: Model, health: BatchHealth) -> Batcher[int, int]:
    """A batcher whose warm-up did not run (`STEADY_WARMUP` off): no known-good rows."""
    return Batcher(
        "m",
        TWO_BUCKETS,
        model,
        length_of=lambda row: max(row, 1),
        dispatcher=InlineDispatcher(),  # type: ignore[arg-type]
        slots=ComputeSlots(1),
        metrics=Metrics(),
        clock=model.clock,
        on_batch_done=health.record,
    )


async def warmed_batcher(model: Model, health: BatchHealth) -> Batcher[int, int]:
    """A batcher whose warm-up ran (its rows of zeros are the known-good rows)."""
    batcher = cold_batcher(model, health)
    await batcher.warm_up_rows(lambda shape: [0] * shape.batch, lambda done, total: None)
    model.ran.clear()
    return batcher


async def answer(futures: list[asyncio.Future[ItemResult[int]]]) -> list[FromEngine]:
    """What the request's answer (`gather_rows`, as the engine's hosts run it) emits."""
    emitted: list[FromEngine] = []
    request = Submit(7, "m", deadline=1e9, payload=EmbedPayload([[1]]))
    await gather_rows(futures, request, emitted.append, Metrics())
    return emitted


LOST = RuntimeError("CUDA error: an illegal memory access was encountered")
CUBLAS_ALLOC_FAILED = RuntimeError(
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
)
SERVER_FAULTS = [MemoryError(), OutOfMemoryError("CUDA out of memory"), LOST, CUBLAS_ALLOC_FAILED]
IDS = ["memory", "torch-oom", "device-lost", "cublas-alloc"]


@pytest.mark.parametrize("fault", SERVER_FAULTS, ids=IDS)
async def test_a_row_the_server_fails_alone_is_answered_500_and_counts_toward_ill_health(
    fault: Exception,
) -> None:
    """Its known-good row computing, the row's out of memory was blamed on its input: 400
    "could not process input 0 (OutOfMemoryError)", and the batch reset the engine's count
    of failed batches (a lost device alone went unnoticed)."""
    model = Model(heavy_fault=fault)
    health = BatchHealth(threshold=3)
    batcher = await warmed_batcher(model, health)
    (good,) = batcher.submit([1], deadline=100.0)
    heavy = batcher.submit([HEAVY], deadline=100.0)
    bad = batcher.submit([BAD], deadline=100.0)
    batcher.start()
    emitted = await answer(heavy)
    await batcher.close()
    assert [m.kind for m in emitted] == [FailureKind.FAILED]  # type: ignore[union-attr]
    assert (await good).value == 2
    assert isinstance(bad[0].exception(), BatchFailed)  # after it: not run, the server's
    assert model.ran == [[1, HEAVY, BAD], [0], [1], [HEAVY]]
    assert health.consecutive_failures == 1
    assert health.lost_device == (fault is LOST)


@pytest.mark.parametrize("fault", SERVER_FAULTS, ids=IDS)
async def test_a_batch_the_server_failed_fails_every_row_without_running_any_again(
    fault: Exception,
) -> None:
    """A lost device was found by running the known-good row (on a real device, one more
    slow failure); without one (warm-up off), by running every row alone."""
    model = Model()
    health = BatchHealth(threshold=3)
    batcher = await warmed_batcher(model, health)
    model.batch_fault = fault
    futures = batcher.submit([1, 2], deadline=100.0)
    batcher.start()
    await asyncio.wait(futures)
    await batcher.close()
    assert all(isinstance(future.exception(), BatchFailed) for future in futures)
    assert model.ran == [[1, 2]]
    assert health.consecutive_failures == 1 and health.lost_device == (fault is LOST)


async def test_rows_nobody_waits_for_are_not_run_alone_and_a_late_one_is_answered_504() -> None:
    """While the failed batch's known-good row runs, one row's client leaves and another
    row's deadline passes: they were run alone all the same (one slow run after another,
    holding a compute slot), the late one answered as a late success, not 504, and its
    request's input queued in another bucket computed too."""
    model = Model()
    health = BatchHealth(threshold=3)
    batcher = await warmed_batcher(model, health)
    start = model.now
    (good,) = batcher.submit([1], deadline=start + 100)
    late = batcher.submit([2, LONG], deadline=start + 2.5)  # it ends at start + 3 alone
    (gone,) = batcher.submit([4], deadline=start + 100)
    (bad,) = batcher.submit([BAD], deadline=start + 100)
    model.on_known_good = gone.cancel  # its client disconnects
    batcher.start()
    await asyncio.wait([good, late[0], bad])
    assert batcher.scheduler.depth == 0  # `late`'s long input was withdrawn with it
    late[1].cancel()  # its request's answer does that
    await batcher.close()
    assert (await good).value == 2
    assert isinstance(late[0].exception(), DeadlineExceeded)
    assert str(late[0].exception()) == RERUN_DEADLINE_PASSED  # it had left the queue
    assert isinstance(bad.exception(), InputFailed)
    # The batch at start + 1, the known-good row at + 2, `good` alone at + 3: `late` can
    # no longer make its deadline, and `gone` is gone.
    assert model.ran == [[1, 2, 4, BAD], [0], [1], [BAD]]
    assert health.consecutive_failures == 0


async def test_a_failed_batch_whose_rows_all_went_without_a_known_good_row_is_a_strike() -> None:
    """Both clients left while the batch failed, and warm-up was off: nothing computed,
    yet health heard of a success and cleared its count, so a server whose failures
    outlast every deadline (or every client's patience) never turned unhealthy."""
    model = Model()
    health = BatchHealth(threshold=3)
    for _ in range(2):
        health.record(IndexError("an earlier failed batch"))
    batcher = cold_batcher(model, health)
    model.batch_fault = IndexError("index out of range")
    futures = batcher.submit([1], deadline=100.0) + batcher.submit([2], deadline=100.0)

    def clients_leave() -> None:
        for future in futures:
            future.cancel()

    model.on_batch = clients_leave
    batcher.start()
    await batcher.close()
    assert model.ran == [[1, 2]]
    assert health.consecutive_failures == 3 and not health.healthy


@pytest.mark.parametrize("fault", SERVER_FAULTS, ids=IDS)
async def test_without_a_known_good_row_a_row_failed_before_the_server_s_fault_is_a_500(
    fault: Exception,
) -> None:
    """Warm-up off: the BAD row failed alone, then the HEAVY one ran out of memory, nothing
    computed in between. The BAD row was answered 400 (its client told not to retry) for
    what is evidence of a failing server, as the HEAVY one is answered 500."""
    model = Model(heavy_fault=fault)
    health = BatchHealth(threshold=3)
    batcher = cold_batcher(model, health)
    bad = batcher.submit([BAD], deadline=100.0)
    heavy = batcher.submit([HEAVY], deadline=100.0)
    batcher.start()
    emitted = await answer(bad) + await answer(heavy)
    await batcher.close()
    assert [m.kind for m in emitted] == [FailureKind.FAILED] * 2  # type: ignore[union-attr]
    assert model.ran == [[BAD, HEAVY], [BAD], [HEAVY]]
    assert health.consecutive_failures == 1


@pytest.mark.parametrize("warmed", [True, False], ids=["known-good", "warm-up-off"])
async def test_a_request_failed_by_one_row_alone_has_no_other_row_run_alone(warmed: bool) -> None:
    """The request is answered 400 with its first failed row, its other rows unread: they
    were run alone all the same, one after another on the shared compute slot, as the row's
    failure reached it only once the whole triage was done. Its fault is certain once the
    server computed (the known-good row, or warm-up off, another row alone)."""
    model = Model()
    health = BatchHealth(threshold=3)
    batcher = await warmed_batcher(model, health) if warmed else cold_batcher(model, health)
    failing = batcher.submit([BAD, 1, 2], deadline=100.0)
    (other,) = batcher.submit([4], deadline=100.0)
    batcher.start()
    emitted = await answer(failing)
    await batcher.close()
    [failure] = emitted
    assert failure.kind == FailureKind.BAD_REQUEST and failure.input_index == 0  # type: ignore[union-attr]
    assert (await other).value == 8
    certain = [[0], [BAD]] if warmed else [[BAD], [1]]
    assert model.ran == [[BAD, 1, 2, 4], *certain, [4]]
    assert health.consecutive_failures == 0


@pytest.mark.parametrize("warmed", [True, False], ids=["known-good", "warm-up-off"])
async def test_a_batch_of_one_failed_in_passing_is_answered_from_its_run_alone(
    warmed: bool,
) -> None:
    """A passing fault of the server's (one `server_fault` does not know) failed a batch
    of one row: the row was never run again, but blamed on its input (400, and health's
    count of failed batches cleared) once the known-good row computed, or answered 500
    without one; two rows with the same fault were each run again and answered."""
    model = Model()
    health = BatchHealth(threshold=3)
    batcher = await warmed_batcher(model, health) if warmed else cold_batcher(model, health)
    model.next_fault = RuntimeError("a passing fault of the server's")
    (row,) = batcher.submit([5], deadline=100.0)
    batcher.start()
    await asyncio.wait([row])
    await batcher.close()
    assert (await row).value == 10
    assert model.ran == [[5], *([[0]] if warmed else []), [5]]
    assert health.consecutive_failures == 0


class TimedModel(Model):
    """`Model` whose runs measure what its clock moves (`RUN_S`), so the scheduler's
    estimates are the clock's: `backlogs` holds the scheduler's backlog at each run's end."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler: Scheduler | None = None
        self.backlogs: list[float] = []

    def __call__(self, shape: BatchShape, rows: Sequence[int]) -> Computed:
        try:
            computed = super().__call__(shape, rows)
        finally:
            if self.scheduler is not None:
                self.backlogs.append(self.scheduler.backlog_seconds(self.now))
        return Computed(computed.rows, SlotTimings(RUN_S, acquire_wait_s=0.0, pool_miss=False))


async def test_a_failed_batch_counts_in_the_backlog_while_its_rows_run_again() -> None:
    """Its triage holds the compute slot for a known-good row and each row alone, one run
    after another: the backlog counted the batch only until its own estimate ran out, so
    admission read the slot as free and let in requests that waited behind the triage
    and ended 504. A row skipped (its client left) is a run less."""
    model = TimedModel()
    health = BatchHealth(threshold=3)
    batcher = await warmed_batcher(model, health)
    model.scheduler = batcher.scheduler
    start = model.now
    (good,) = batcher.submit([1], deadline=start + 100)
    (bad,) = batcher.submit([BAD], deadline=start + 100)
    (gone,) = batcher.submit([4], deadline=start + 100)
    (other,) = batcher.submit([2], deadline=start + 100)
    model.on_known_good = gone.cancel  # its client disconnects
    batcher.start()
    await asyncio.wait([good, bad, other])
    await batcher.close()
    assert (await good).value == 2 and (await other).value == 4
    assert isinstance(bad.exception(), InputFailed)
    assert model.ran == [[1, BAD, 4, 2], [0], [1], [BAD], [2]]
    # The batch ends as estimated; then 5 runs to come (known-good, 4 rows), 1 s each:
    # at the known-good row's end 4 s left, then 3, 2; `gone` skipped; `other` the last.
    assert model.backlogs == [0.0, 4.0, 3.0, 2.0, 0.0]
    assert batcher.scheduler.backlog_seconds(model.now) == 0.0
