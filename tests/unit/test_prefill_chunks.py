"""Chunked prefill's bookkeeping, without a model: a sequence's rows over a long prompt (a
chunk a step, only the last choosing a token), the steps it counts for its slot's forecast,
and the joiners a step's prefill budget admits beside sequences still prefilling."""

from __future__ import annotations

import dataclasses

import pytest

from app.engine.generation_batch import SequenceTable
from app.engine.generation_sequences import steps_for
from app.engine.generation_steps import StepResult
from tests.support.stand_in_sequence import stand_in_sequence


def long(prompt_tokens: int, chunk: int, max_new_tokens: int = 5):  # type: ignore[no-untyped-def]
    sequence = stand_in_sequence(max_new_tokens)
    return dataclasses.replace(
        sequence, prompt=list(range(3, 3 + prompt_tokens)), chunk_tokens=chunk
    )


async def test_a_long_prompt_is_fed_a_chunk_a_step_and_only_the_last_chooses() -> None:
    sequence = long(20, 8)
    sequence.slot = 0
    rows = []
    while sequence.prefilling:
        rows.append(sequence.row())
        assert sequence.row() == rows[-1]  # a rerun (triage) gets the same row
        sequence.chunk_computed()
    assert [(r.start, len(r.token_ids), r.prefill) for r in rows] == [
        (0, 8, True), (8, 8, True), (16, 4, True)
    ]  # fmt: skip
    assert [r.next_prompt_token for r in rows] == [11, 19, None]
    assert [r.chooses for r in rows] == [False, False, True]
    assert [t for r in rows for t in r.token_ids] == sequence.prompt
    sequence.take([7], frozenset({2}))
    decode = sequence.row()
    assert (decode.start, list(decode.token_ids), decode.prefill) == (20, [7], False)


async def test_its_forecast_counts_its_prefill_chunks_and_multi_step_waits() -> None:
    sequence = long(20, 8, max_new_tokens=5)
    assert sequence.prefill_steps() == 2 and sequence.steps_left() == 7
    assert steps_for([sequence], 4) == 1
    sequence.chunk_computed()
    assert sequence.steps_left() == 6 and steps_for([sequence], 4) == 1
    table = SequenceTable(1)
    table.queue(long(20, 8, max_new_tokens=5))
    table.join(1000, 0.0)
    table.queue(long(3, 8))
    # A sequence queued now waits for the running one's 2 chunk steps and 5 tokens, then
    # for the waiting one's 5 tokens (its 3-token prompt is one chunk).
    assert table.steps_until_a_slot() == 7 + 5


async def test_the_prefill_budget_counts_the_chunks_of_those_still_prefilling() -> None:
    table = SequenceTable(8)
    for _ in range(2):
        table.queue(long(100, 16))
    assert len(table.join(32, 0.0)) == 2  # 2 rows x 16
    for _ in range(3):
        table.queue(long(100, 16))
    assert table.join(32, 0.0) == []  # 2 still prefill: a third row would be 48 tokens


async def test_its_published_work_is_a_step_a_turn_prefilling_or_decoding() -> None:
    """Another model in line ends a multi-step run after its current step: whether a
    sequence prefills (its chunks) or decodes, the published turn is one step, and each of
    its steps a turn."""
    table = SequenceTable(1)
    table.queue(long(20, 8, max_new_tokens=5))
    table.join(1000, 0.0)
    prefilling = table.work(0.01, max_waiting=8)
    assert prefilling.next_batch_s == 0.01 and prefilling.turns == 7
    running = next(iter(table.running.values()))
    while running.prefilling:
        running.chunk_computed()
    table.changed()
    decoding = table.work(0.01, max_waiting=8)
    assert decoding.next_batch_s == 0.01 and decoding.turns == 5


async def test_a_run_stops_at_the_deadline_of_a_sequence_that_does_not_stream() -> None:
    """Its tokens are taken, and its deadline checked, only as the run ends: the run is no
    longer than the steps of `step_s` until its deadline (one that streams is checked every
    step: its deadline does not shorten the run)."""
    held = long(4, 8, max_new_tokens=100)
    held.prefilled = len(held.prompt)
    held.streams = False
    assert held.request.deadline > 100.0  # the premise: far off
    deadline = held.request.deadline
    assert steps_for([held], 16, now=deadline - 3.5, step_s=1.0) == 3
    assert steps_for([held], 16, now=deadline - 0.5, step_s=1.0) == 1  # at least one
    assert steps_for([held], 16) == 16  # no step time yet: none to plan with
    held.streams = True
    assert steps_for([held], 16, now=deadline - 3.5, step_s=1.0) == 16


def test_the_step_time_average_weighs_a_run_as_its_steps() -> None:
    """Alternating a one-step prefill dispatch of 100 ms and a 12-step decode run of 20 ms a
    step, the average settles near the steps' mean (~26 ms), each step weighed as if
    recorded alone; a dispatch weighed once whatever its steps, it sat near 60 ms, and
    admission, the fitted lengths and the deadline checks all read it."""
    average = 0.0
    for _ in range(50):
        average = StepResult([], 0.100, 1).averaged_into(average)
        average = StepResult([], 0.240, 12).averaged_into(average)
    assert 0.020 < average < 0.040, average
    one_by_one = 0.030
    for _ in range(12):
        one_by_one = StepResult([], 0.020, 1).averaged_into(one_by_one)
    assert StepResult([], 0.240, 12).averaged_into(0.030) == pytest.approx(one_by_one)
