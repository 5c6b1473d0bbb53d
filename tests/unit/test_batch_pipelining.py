"""A batch's compute slot goes to the next ready batch before the last batch's answers are
delivered: the batch loop used to start it only after the loop had run every answer's
task (their encoding and sending), and the compute thread idled meanwhile, ~7 % of the
engine's time at 64 connections on 2 CPUs (docs/BENCHMARKS.md). Over the inline fake
dispatcher (tests/support/inline_batching.py), whose batch runs within the step that starts
it: the event loop's order of callbacks decides, with no sleeps."""

from __future__ import annotations

from collections.abc import Sequence

from app.batcher import Batcher
from app.compute_slots import ComputeSlots
from app.metrics import Metrics
from app.scheduler import BatchPolicy, BatchShape
from tests.support.inline_batching import Computed, InlineDispatcher

FOUR_A_BATCH = BatchPolicy(
    length_buckets=(16,), max_batch_size=4, max_batch_tokens=64, max_wait_s=0
)


async def test_the_next_batch_starts_before_the_last_batch_s_answers_are_delivered() -> None:
    ran: list[list[int]] = []

    def model(shape: BatchShape, rows: Sequence[int]) -> Computed:
        ran.append(list(rows))
        return Computed(rows)

    batcher: Batcher[int, int] = Batcher(
        "m",
        FOUR_A_BATCH,
        model,
        length_of=lambda row: row,
        dispatcher=InlineDispatcher(),  # type: ignore[arg-type]
        slots=ComputeSlots(1),
        metrics=Metrics(),
        clock=lambda: 0.0,
    )
    futures = batcher.submit([1, 2, 3, 4, 5, 6, 7, 8], deadline=10.0)
    batches_run_when_the_first_answer_came: list[int] = []
    futures[0].add_done_callback(lambda _: batches_run_when_the_first_answer_came.append(len(ran)))
    batcher.start()
    for future in futures:
        await future
    assert ran == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert batches_run_when_the_first_answer_came == [2]
    assert [future.result().value for future in futures] == [2, 4, 6, 8, 10, 12, 14, 16]
    await batcher.close()
