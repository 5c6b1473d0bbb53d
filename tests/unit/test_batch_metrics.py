"""What the batcher records of inputs that never computed in a batch: the queue wait of an
input that leaves the queue otherwise (expired, cancelled, withdrawn with its failed
request) is observed as a batch's inputs' waits are. Over the inline fake dispatcher
(tests/support/inline_batching.py) on a clock the test moves."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from app.batcher import Batcher
from app.compute_slots import ComputeSlots
from app.failures import BatchFailed, DeadlineExceeded
from app.metrics import Metrics
from app.scheduler import BatchPolicy, BatchShape
from tests.support.inline_batching import Computed, InlineDispatcher
from tests.support.manual_clock import ManualClock

POLICY = BatchPolicy(
    length_buckets=(16, 32), max_batch_size=4, max_batch_tokens=128, max_wait_s=0.0
)


def batcher_on(clock: ManualClock, execute: object = None) -> Batcher[int, int]:
    """A batcher of int rows (a row is its own length) computing each doubled, or with
    `execute`."""
    return Batcher(
        "m",
        POLICY,
        execute or (lambda shape, rows: Computed(rows)),  # type: ignore[arg-type]
        length_of=lambda row: row,
        dispatcher=InlineDispatcher(),  # type: ignore[arg-type]
        slots=ComputeSlots(1),
        metrics=Metrics(),
        clock=clock,
    )


def queue_wait(batcher: Batcher[int, int], bucket: str) -> tuple[float, float]:
    """The queue-wait histogram's count and sum for model m and `bucket`."""
    registry = batcher._metrics.registry
    labels = {"model": "m", "bucket": bucket}
    name = "steadyserve_queue_wait_seconds"
    count = registry.get_sample_value(f"{name}_count", labels)
    total = registry.get_sample_value(f"{name}_sum", labels)
    return count or 0.0, total or 0.0


async def test_an_input_that_expires_in_the_queue_has_its_wait_observed() -> None:
    """Under overload most waits end in expiry: observed only for inputs that made a
    batch, the histogram's p99 was capped at what the survivors waited."""
    clock = ManualClock(100.0)
    batcher = batcher_on(clock)
    [expiring] = batcher.submit([5], deadline=100.5)
    clock.now = 101.0  # past its deadline before any batch could take it
    batcher.start()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(expiring, 5)
    await batcher.close()
    assert queue_wait(batcher, "16") == (1.0, pytest.approx(1.0))


async def test_a_cancelled_input_has_its_wait_until_its_cancel_observed() -> None:
    clock = ManualClock(100.0)
    batcher = batcher_on(clock)
    [cancelled] = batcher.submit([5], deadline=200.0)
    clock.now = 100.25
    [served] = batcher.submit([20], deadline=200.0)
    cancelled.cancel()  # its client went away before a batch took it
    batcher.start()
    assert (await asyncio.wait_for(served, 5)).value == 40
    await batcher.close()
    assert queue_wait(batcher, "16") == (1.0, pytest.approx(0.25))
    assert queue_wait(batcher, "32") == (1.0, 0.0)


async def test_an_input_withdrawn_with_its_failed_request_has_its_wait_observed() -> None:
    """A request's input fails in its batch and in its run alone (1 s of compute each):
    its other input, still queued in another bucket, is withdrawn then, after 2 s."""
    clock = ManualClock(100.0)

    def fails_for_short_rows(shape: BatchShape, rows: Sequence[int]) -> Computed:
        clock.now += 1.0
        if shape.length == 16:
            raise RuntimeError("this bucket's batches fail")
        return Computed(rows)

    batcher = batcher_on(clock, fails_for_short_rows)
    short, long = batcher.submit([5, 20], deadline=200.0)
    batcher.start()
    with pytest.raises(BatchFailed):
        await asyncio.wait_for(short, 5)
    await batcher.close()
    assert not long.done()  # its request's answer, not the batcher, cancels it
    assert queue_wait(batcher, "16") == (1.0, 0.0)  # its batch started at once
    assert queue_wait(batcher, "32") == (1.0, pytest.approx(2.0))
