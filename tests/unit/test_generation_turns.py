"""A generate model's work on the compute slots, as other models' admission counts it
(`SequenceTable.work`, `model_queues.wait_ahead`): a step a turn (another model in line
ends a multi-step run after its current step), for as many turns as its sequences take at
most."""

from __future__ import annotations

import pytest

from app.engine.generation_batch import SequenceTable
from app.model_queues import ModelWork, wait_ahead
from tests.support.stand_in_sequence import stand_in_sequence as sequence


async def test_a_generate_model_takes_a_turn_while_its_sequences_have_tokens_to_make() -> None:
    table = SequenceTable(2)
    assert table.work(0.005, 64) == ModelWork(0.0, 0.0, 0.0, turns=0)
    short, long = sequence(3), sequence(10)
    table.queue(short)
    table.queue(long)
    table.join(max_batch_tokens=64, now=0.0)
    # Running alone: until the longest ends, 10 steps, a turn each. A sequence queued now
    # waits 3 steps for the short one's slot.
    running = ModelWork(0.0, 0.0, 0.005, batches_ahead=3, turns=10, own_wait_s=0.015)
    assert table.work(0.005, 64) == running
    # A sequence waiting for a slot starts no later than one queued now would (8 steps:
    # the short one's slot, then behind the waiting one's 5), and ends 5 steps on.
    table.queue(sequence(5))
    waiting = ModelWork(0.0, 0.0, 0.005, batches_ahead=8, turns=13, own_wait_s=0.040)
    assert table.work(0.005, 64) == waiting
    assert table.work(0.005, 1).at_cap  # `generate_max_waiting` wait, no slot free
    # An embedding model's input behind 20 batches of its own waits for 13 dispatches.
    works = {"tiny": waiting, "minilm": ModelWork(0.0, 0.8, 0.04, 20, 21)}
    assert wait_ahead("minilm", works, 1) == pytest.approx(0.8 + 13 * 0.005)
    # A new sequence waits 8 steps for a slot, and a batch of `minilm` before each and
    # before its own first.
    assert wait_ahead("tiny", works, 1) == pytest.approx(9 * 0.04 + 8 * 0.005)
