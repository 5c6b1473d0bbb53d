"""What the batcher asks the scheduler as it answers the inputs a poll expired: a failed
input withdraws its request's inputs still queued, and only those. A request's inputs
expire together (they share its deadline), and each one's failure used to ask `withdraw`
for the others already expired with it, still pending as they were popped one at a time:
(k-1) ids per input of a k-input request, each a walk of the queue. Over the inline fake
dispatcher (tests/support/inline_batching.py) on a clock the test sets."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

import pytest

from app.batcher import Batcher
from app.compute_slots import ComputeSlots
from app.failures import DeadlineExceeded
from app.metrics import Metrics
from app.scheduler import BatchPolicy, BatchShape, WorkItem
from tests.support.inline_batching import Computed, InlineDispatcher
from tests.support.manual_clock import ManualClock


def batcher_on(clock: ManualClock, max_wait_s: float) -> tuple[Batcher[int, int], list[list[int]]]:
    """A batcher of int rows (a row is its own length), and the ids each `withdraw` asks."""
    policy = BatchPolicy(
        length_buckets=(16, 32), max_batch_size=4, max_batch_tokens=128, max_wait_s=max_wait_s
    )
    batcher: Batcher[int, int] = Batcher(
        "m",
        policy,
        lambda shape, rows: Computed(rows),  # type: ignore[arg-type]
        length_of=lambda row: row,
        dispatcher=InlineDispatcher(),  # type: ignore[arg-type]
        slots=ComputeSlots(1),
        metrics=Metrics(),
        clock=clock,
    )
    asked: list[list[int]] = []
    withdraw = batcher.scheduler.withdraw

    def spy(item_ids: Collection[int]) -> tuple[WorkItem, ...]:
        asked.append(sorted(item_ids))
        return withdraw(item_ids)

    batcher.scheduler.withdraw = spy  # type: ignore[method-assign]
    return batcher, asked


async def test_a_request_whose_inputs_all_expire_withdraws_none_of_them() -> None:
    clock = ManualClock(100.0)
    batcher, asked = batcher_on(clock, max_wait_s=0.0)
    expiring = batcher.submit([5] * 64, deadline=100.5)
    clock.now = 101.0  # past its deadline before any batch could take it
    batcher.start()
    for future in expiring:
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(future, 5)
    await batcher.close()
    assert asked == []  # was 63 asks, of 63 ids down to 1, none of them queued


async def test_an_expired_input_withdraws_only_its_siblings_still_queued() -> None:
    """The long inputs cannot finish in time (1 s alone), the short ones still can: the
    first long one's failure withdraws the short ones, not the other long one."""
    clock = ManualClock(100.0)
    batcher, asked = batcher_on(clock, max_wait_s=10.0)
    batcher.scheduler.record_compute(BatchShape(1, 32), 1.0)
    short_1, short_2, long_1, long_2 = batcher.submit([5, 5, 20, 20], deadline=100.5)
    batcher.start()
    for future in (long_1, long_2):
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(future, 5)
    await batcher.close()
    assert batcher.scheduler.depth == 0
    assert not short_1.done() and not short_2.done()  # its request's answer cancels them
    assert asked == [[0, 1]]  # was [[0, 1, 3]]: the other long one, expired too
