"""What the batcher records of what did not go as planned: the queue wait of an input that
leaves the queue otherwise than in a batch (expired, cancelled, withdrawn with its failed
request) is observed as a batch's inputs' waits are; a failed batch and its rows' runs
alone are charged to the busy time, and its unwarmed shape counted. Over the inline fake
dispatcher (tests/support/inline_batching.py) on a clock the test moves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from app.batcher import Batcher
from app.compute_slots import ComputeSlots
from app.execute import SlotTimings
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


def counter(batcher: Batcher[int, int], name: str) -> float:
    value = batcher._metrics.registry.get_sample_value(name, {"model": "m"})
    return value or 0.0


async def test_a_failed_batch_and_its_rows_run_alone_are_charged_to_the_busy_time() -> None:
    """The batch of two fails after 50 ms; each row alone then takes 100 ms on the thread
    (its own `compute_s` says none: a pool wait is not compute). Only a batch that computed
    was charged, so in a failure storm the busy time read the compute threads idle while
    every one ran batches that failed; and a batch that computed was charged its
    `compute_s`, one that raised its time on the thread: both are the thread's time now."""

    def fails_together(shape: BatchShape, rows: Sequence[int]) -> Computed:
        time.sleep(0.05 if len(rows) > 1 else 0.1)  # on the real clock busy time is read by
        if len(rows) > 1:
            raise RuntimeError("this batch fails")
        return Computed(rows, SlotTimings(compute_s=0.0, acquire_wait_s=0.0, pool_miss=False))

    batcher = batcher_on(ManualClock(100.0), fails_together)
    futures = batcher.submit([5, 6], deadline=200.0)
    batcher.start()
    answers = await asyncio.wait_for(asyncio.gather(*futures), 5)
    await batcher.close()
    assert [answer.value for answer in answers] == [10, 12]  # from their runs alone
    busy = counter(batcher, "steadyserve_dispatcher_busy_seconds_total")
    assert 0.05 + 2 * 0.1 <= busy < 0.05 + 2 * 0.1 + 1.0


async def test_the_queue_wait_histogram_is_labelled_once_a_bucket() -> None:
    """An overload that expires thousands of inputs in one turn of the batch loop looked up
    the histogram's labels (a string and a locked dictionary) for each of them."""
    clock = ManualClock(100.0)
    batcher = batcher_on(clock)
    looked_up: list[tuple[str, ...]] = []
    labels = batcher._metrics.queue_wait.labels

    def counted(*values: str) -> object:
        looked_up.append(values)
        return labels(*values)

    batcher._metrics.queue_wait.labels = counted  # type: ignore[method-assign]
    expiring = [f for _ in range(50) for f in batcher.submit([5, 20], deadline=100.5)]
    clock.now = 101.0
    batcher.start()
    outcomes = await asyncio.gather(*expiring, return_exceptions=True)
    await batcher.close()
    assert all(isinstance(outcome, DeadlineExceeded) for outcome in outcomes)
    assert sorted(looked_up) == [("m", "16"), ("m", "32")]
    assert queue_wait(batcher, "16") == (50.0, pytest.approx(50.0))


async def test_a_failing_batch_at_an_unwarmed_shape_is_counted_once() -> None:
    """The shape was marked seen before the batch computed, and counted only once it had:
    a failing unwarmed shape was never counted, not then nor at its next batch."""

    def always_fails(shape: BatchShape, rows: Sequence[int]) -> Computed:
        raise RuntimeError("every batch fails")

    batcher = batcher_on(ManualClock(100.0), always_fails)
    batcher.start()
    for _ in range(2):
        [failing] = batcher.submit([5], deadline=200.0)
        with pytest.raises(BatchFailed):
            await asyncio.wait_for(failing, 5)
    await batcher.close()
    assert counter(batcher, "steadyserve_unwarmed_shapes_total") == 1.0
