"""A generation sequence's own rules: which chosen tokens it keeps and why it ends."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from app.engine.protocol import FinishReason, SamplingParams
from app.models.causal_lm import StepRow
from tests.support.decode_runs import HandOvers, run_decode
from tests.support.stand_in_sequence import stand_in_sequence as sequence

EOS = frozenset({2})


async def test_tokens_are_kept_up_to_eos_which_is_not() -> None:
    seq = sequence(10)
    assert seq.take([7, 8], EOS) == ([7, 8], None)
    assert seq.take([9, 2, 11], EOS) == ([9], FinishReason.EOS)
    assert seq.generated == [7, 8, 9]


async def test_a_run_past_the_length_is_cut_at_it() -> None:
    seq = sequence(3)
    assert seq.take([7, 8, 9, 10], EOS) == ([7, 8, 9], FinishReason.LENGTH)
    assert seq.remaining == 0


async def test_time_per_output_token_needs_two_tokens() -> None:
    seq = sequence(10)
    seq.first_token_at = seq.last_token_at = 1.0
    seq.take([7], EOS)
    assert seq.time_per_output_token() is None
    seq.take([8, 9], EOS)
    seq.last_token_at = 2.0
    assert seq.time_per_output_token() == 0.5


async def test_a_stop_token_ends_it_as_eos_does_and_is_not_kept() -> None:
    """A stop string that is a special token's text reaches the engine as its id."""
    seq = sequence(10, stop_token_ids=(9,))
    assert seq.take([7, 9, 8], EOS) == ([7], FinishReason.EOS)
    assert seq.generated == [7]
    assert sequence(10).take([7, 9, 8], EOS) == ([7, 9, 8], None)  # another's stop


def test_a_multi_step_run_ends_a_row_at_its_stop_token() -> None:
    """As at EOS: the row chose its last token; the other rows run on."""
    runner = _ScriptedRunner({0: [7, 9, 8, 8], 1: [5, 5, 5, 5]})
    stops = SamplingParams(max_new_tokens=10, stop_token_ids=(9,))
    rows = [
        StepRow(0, (4,), 3, stops, torch.Generator()),
        StepRow(1, (4,), 3, SamplingParams(max_new_tokens=10), torch.Generator()),
    ]
    assert run_decode(runner, rows, 4) == {0: [7, 9], 1: [5, 5, 5, 5]}


def test_a_run_hands_streamed_rows_over_each_step_and_the_others_as_it_ends() -> None:
    """Slot 0 streams: each of its tokens goes over as its step ends, the run going on;
    slot 1's come in one hand-over with the last step's, which says the run ended."""
    runner = _ScriptedRunner({0: [7, 8, 9], 1: [5, 6, 4]})
    rows = [
        StepRow(0, (4,), 3, SamplingParams(max_new_tokens=10), torch.Generator()),
        StepRow(1, (4,), 3, SamplingParams(max_new_tokens=10), torch.Generator()),
    ]
    handed: HandOvers = []
    run_decode(runner, rows, 3, each_step=frozenset({0}), handed=handed)
    assert handed == [
        ([0], [[7]], True),
        ([0], [[8]], True),
        ([0, 1], [[9], [5, 6, 4]], False),
    ]


class _ScriptedRunner:
    """The runner a `StepRunner` drives: each slot's next token from its script."""

    name = "tiny"
    eos_token_ids = EOS

    def __init__(self, scripts: dict[int, list[int]]) -> None:
        self.scripts = scripts

    def step(self, rows: list[StepRow]) -> list[int]:
        return [self.scripts[row.slot].pop(0) for row in rows]


def _context() -> SimpleNamespace:
    busy = SimpleNamespace(labels=lambda name: None)
    return SimpleNamespace(metrics=SimpleNamespace(dispatcher_busy=busy), clock=lambda: 0.0)
