"""A batch's compute slot goes to the next ready batch before the last batch's answers are
delivered: the batch loop used to start it only after the loop had run every answer's
task (their encoding and sending), and the compute thread idled meanwhile, ~7 % of the
engine's time at 64 connections on 2 CPUs (docs/BENCHMARKS.md). Over the inline fake
dispatcher (tests/support/inline_batching.py), whose batch runs within the step that starts
it: the event loop's order of callbacks decides, with no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from app.compute_slots import ComputeSlots
from app.failures import BatchFailed
from app.scheduler import BatchPolicy, BatchShape, Decision
from tests.support.inline_batching import Computed, inline_batcher

FOUR_A_BATCH = BatchPolicy(
    length_buckets=(16,), max_batch_size=4, max_batch_tokens=64, max_wait_s=0
)


class Model:
    """Computes each row doubled (`Computed`) and records the batches it was given."""

    def __init__(self) -> None:
        self.ran: list[list[int]] = []

    def __call__(self, shape: BatchShape, rows: Sequence[int]) -> Computed:
        self.ran.append(list(rows))
        return Computed(rows)


async def test_the_next_batch_starts_before_the_last_batch_s_answers_are_delivered() -> None:
    model = Model()
    batcher = inline_batcher(model, ComputeSlots(1), FOUR_A_BATCH)
    futures = batcher.submit([1, 2, 3, 4, 5, 6, 7, 8], deadline=10.0)
    batches_run_when_the_first_answer_came: list[int] = []
    futures[0].add_done_callback(
        lambda _: batches_run_when_the_first_answer_came.append(len(model.ran))
    )
    batcher.start()
    for future in futures:
        await future
    assert model.ran == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert batches_run_when_the_first_answer_came == [2]
    assert [future.result().value for future in futures] == [2, 4, 6, 8, 10, 12, 14, 16]
    await batcher.close()


async def test_the_next_batch_is_planned_on_the_compute_time_of_the_batch_before() -> None:
    """Started before the last batch's answers, the next batch was polled before the last
    one's compute time was recorded: without warm-up a new shape's second batch was
    planned (its share of the backlog, its deadline checks) on an estimate of 0."""
    batcher = inline_batcher(Model(), ComputeSlots(1), FOUR_A_BATCH)
    shape = BatchShape(4, 16)
    estimates_when_a_batch_closed: list[float] = []
    poll = batcher.scheduler.poll

    def polled(now: float) -> Decision:
        estimate = batcher.scheduler.estimated_compute(shape)
        decision = poll(now)
        if decision.batch is not None:
            estimates_when_a_batch_closed.append(estimate)
        return decision

    batcher.scheduler.poll = polled  # type: ignore[method-assign]
    futures = batcher.submit([1, 2, 3, 4, 5, 6, 7, 8], deadline=10.0)
    batcher.start()
    await asyncio.wait_for(asyncio.gather(*futures), 5)
    assert estimates_when_a_batch_closed[0] == 0.0  # nothing measured before the first
    assert estimates_when_a_batch_closed[1] > 0.0
    await batcher.close()


async def test_a_fault_starting_the_next_batch_still_answers_the_batch_that_ran() -> None:
    """The next batch is started outside the batch loop, whose death fails what is queued
    and restarts it: a bug there left the rows of the batch that had just computed, off
    the queue already, unanswered."""
    batcher = inline_batcher(Model(), ComputeSlots(1), FOUR_A_BATCH)
    polls = 0
    poll = batcher.scheduler.poll

    def second_poll_fails(now: float) -> Decision:
        nonlocal polls
        polls += 1
        if polls == 2:  # the one as the first batch's slot comes back
            raise RuntimeError("a bug in closing batches")
        return poll(now)

    batcher.scheduler.poll = second_poll_fails  # type: ignore[method-assign]
    futures = batcher.submit([1, 2, 3, 4, 5, 6, 7, 8], deadline=10.0)
    batcher.start()
    await asyncio.wait_for(asyncio.wait(futures), 5)
    assert [future.result().value for future in futures[:4]] == [2, 4, 6, 8]
    assert all(isinstance(future.exception(), BatchFailed) for future in futures[4:])
    await asyncio.wait_for(batcher.close(), 5)


async def test_a_fault_before_a_batch_computes_gives_its_compute_slot_back() -> None:
    """What ran before the compute (queue-wait metrics, estimates) had moved out of the
    block that gives the slot back: a fault there kept a compute thread from every model
    for good, and `close` never returned."""
    slots = ComputeSlots(1)
    batcher = inline_batcher(Model(), slots, FOUR_A_BATCH)
    histogram = batcher._metrics.queue_wait
    calls = 0

    def labels_once_broken(*labels: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a metrics bug")
        return histogram.labels(*labels)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(histogram, "labels", labels_once_broken)
        futures = batcher.submit([1, 2, 3, 4], deadline=10.0)
        batcher.start()
        await asyncio.wait_for(asyncio.wait(futures), 5)
    assert [future.result().value for future in futures] == [2, 4, 6, 8]  # run again alone
    assert slots.free == 1
    await asyncio.wait_for(batcher.close(), 5)
