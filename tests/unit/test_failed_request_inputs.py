"""A request answered with one input's failure leaves nothing of it to compute: its inputs
still queued are withdrawn the moment that input fails, its inputs already in a batch are
left to that batch, and the request is answered once, with that failure. Over an inline
fake dispatcher (the batch runs on the event loop, its end one callback after its start),
so the event loop's order of callbacks decides, deterministically, with no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator, Sequence
from typing import TypeVar

import pytest

from app.batch_trace import ItemResult
from app.compute_slots import ComputeSlots
from app.engine.protocol import EmbedPayload, Failure, FailureKind, Submit
from app.engine.rows import gather_rows
from app.failures import BatchFailed, DeadlineExceeded
from app.metrics import Metrics
from app.scheduler import BatchPolicy, BatchShape
from tests.support.inline_batching import Computed, inline_batcher

T = TypeVar("T")
BAD = 3  # a row the fake model throws on
SHORT, LONG = 5, 12  # rows of the 8 and the 16 length bucket (a row is its own length)


class Model:
    """Throws on a batch holding a BAD row, or on every batch once `broken`; records each
    batch it was given."""

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken
        self.ran: list[list[int]] = []

    def __call__(self, shape: BatchShape, rows: Sequence[int]) -> Computed:
        self.ran.append(list(rows))
        if self.broken or BAD in rows:
            raise RuntimeError("the device fell over")
        return Computed(rows)

    def computed(self, row: int) -> bool:
        return any(row in rows for rows in self.ran)


FOUR_A_BATCH = BatchPolicy(
    length_buckets=(16,), max_batch_size=4, max_batch_tokens=64, max_wait_s=0
)
TWO_BUCKETS = BatchPolicy(
    length_buckets=(8, 16), max_batch_size=4, max_batch_tokens=64, max_wait_s=0
)


async def answer(futures: list[asyncio.Future[ItemResult[int]]]) -> list[Failure]:
    """What the request's answer (`gather_rows`, as the engine's hosts run it) emits."""
    emitted: list[Failure] = []
    request = Submit(7, "m", deadline=10.0, payload=EmbedPayload([[1]]))
    results = await gather_rows(futures, request, emitted.append, Metrics())  # type: ignore[arg-type]
    assert results is None
    return emitted


async def _wait_for_as_in_python_3_12(
    awaitable: Awaitable[T],
    timeout: float | None,  # noqa: ASYNC109 (asyncio.wait_for's own signature)
) -> T:
    """Python 3.12's `asyncio.wait_for`: it awaits in the caller's task (3.11 awaits in a
    task of its own, two callbacks later), so a batch loop woken by a batch's end resumes
    before the tasks woken by that batch's answers."""
    async with asyncio.timeout(timeout):
        return await awaitable


@pytest.fixture
def python_3_12_wait_for(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(asyncio, "wait_for", _wait_for_as_in_python_3_12)
    yield


async def test_a_failed_batch_withdraws_its_request_s_queued_input_before_it_ends() -> None:
    """Nobody but the batcher drops the request's fifth input here: it is out of the queue
    by the time its first four's batch ends (left to the request's answer, callbacks later,
    Python 3.12's batch loop took it first), and never computes."""
    model = Model(broken=True)
    depth_at_batch_end: list[int] = []
    batcher = inline_batcher(
        model,
        ComputeSlots(1),
        FOUR_A_BATCH,
        on_batch_done=lambda error: depth_at_batch_end.append(batcher.scheduler.depth),
    )
    futures = batcher.submit([1, 2, 4, 5, 9], deadline=10.0)
    batcher.start()
    await asyncio.wait(futures[:4])
    assert all(isinstance(future.exception(), BatchFailed) for future in futures[:4])
    assert depth_at_batch_end == [0]
    assert not futures[4].done()  # the request's answer cancels it: gather_rows' finally
    futures[4].cancel()
    await batcher.close()
    assert not model.computed(9) and depth_at_batch_end == [0]
    assert batcher.scheduler.depth == 0


async def test_with_python_3_12_s_wait_for_a_failed_request_s_last_input_is_not_computed(
    python_3_12_wait_for: None,
) -> None:
    """The H200 run's failure (Python 3.12), on any Python: the batch loop resumes before
    the request's answer runs, and took the request's fifth input, computing it (and
    failing it) for nobody."""
    model = Model(broken=True)
    slots = ComputeSlots(1)
    batcher = inline_batcher(model, slots, FOUR_A_BATCH)
    futures = batcher.submit([1, 2, 4, 5, 9], deadline=10.0)
    batcher.start()
    emitted = await answer(futures)
    await batcher.close()
    assert [failure.kind for failure in emitted] == [FailureKind.FAILED]
    assert not model.computed(9)
    assert batcher.scheduler.depth == 0 and slots.free == 1


async def test_an_input_already_in_a_batch_is_left_to_it_and_its_slot_comes_back() -> None:
    """The request's long input was taken into a batch in the same turn of the loop as its
    failing short one, and its batch had not yet started: it is no longer queued, so it is
    not withdrawn (the reverted 78d5b1a popped it: its batch then raised outside its `try`,
    its compute slot gone for good), it computes, and nobody reads its result."""
    model = Model()
    slots = ComputeSlots(2)
    batcher = inline_batcher(model, slots, TWO_BUCKETS)
    futures = batcher.submit([LONG, BAD], deadline=10.0)
    request = asyncio.create_task(answer(futures))
    batcher.start()
    emitted = await request
    await asyncio.wait_for(batcher.close(), timeout=10)  # a guard: a leaked slot hangs it
    assert [failure.kind for failure in emitted] == [FailureKind.FAILED]
    # BAD's batch of one, then BAD alone (no known-good row: nothing computed, 500), LONG.
    assert model.ran == [[BAD], [BAD], [LONG]]
    assert slots.free == 2 and batcher.scheduler.depth == 0


@pytest.mark.parametrize("failing_by", ["batch", "deadline"])
async def test_a_request_failed_before_its_answer_runs_is_answered_once_with_that(
    failing_by: str,
) -> None:
    """The request's first input is still queued when its second fails, before the
    request's answer first runs (Python 3.12's batch loop resumes first): the queued one is
    withdrawn, its future left for the answer to cancel. Cancelled at once instead (the
    reverted 78d5b1a), it reached `gather` ahead of the failure, read as the front end's
    cancel: the request went unanswered."""
    model = Model()
    slots = ComputeSlots(1)
    if failing_by == "batch":
        batcher = inline_batcher(model, slots, TWO_BUCKETS)
        first, failing = LONG, BAD  # the short one goes first, alone, and fails
        expected = FailureKind.FAILED
    else:
        policy = BatchPolicy(
            length_buckets=(8, 16), max_batch_size=4, max_batch_tokens=64, max_wait_s=5.0
        )
        batcher = inline_batcher(model, slots, policy)
        # The long bucket's one-row batch takes 2 s: with 1 s left, the long input can no
        # longer make it, and expires; the short one is queued, waiting for more.
        batcher.scheduler.record_compute(BatchShape(1, 16), 2.0)
        first, failing = SHORT, LONG
        expected = FailureKind.DEADLINE
    futures = batcher.submit([first, failing], deadline=1.0)
    batcher.start()
    await asyncio.wait([futures[1]])
    emitted = await answer(futures)
    assert [failure.kind for failure in emitted] == [expected]
    assert batcher.scheduler.depth == 0
    await batcher.close()
    assert not model.computed(first)
    assert futures[0].cancelled() and slots.free == 1  # cancelled by the answer


async def test_an_expired_one_input_request_withdraws_nothing() -> None:
    """Its own id is off the batcher's inputs when it fails: there is nothing of its
    request left to withdraw, and no queue is asked (under overload a poll expires many,
    and each asked for a walk of every queue)."""
    model = Model()
    batcher = inline_batcher(model, ComputeSlots(1), FOUR_A_BATCH)
    asked: list[object] = []
    withdraw = batcher.scheduler.withdraw
    batcher.scheduler.withdraw = lambda ids: asked.append(ids) or withdraw(ids)  # type: ignore[method-assign]
    expired = [batcher.submit([row], deadline=0.0)[0] for row in (1, 2, 4)]  # the clock says 0
    batcher.start()
    await asyncio.wait(expired)
    await batcher.close()
    assert all(isinstance(future.exception(), DeadlineExceeded) for future in expired)
    assert asked == [] and model.ran == []
