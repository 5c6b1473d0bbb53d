"""A generation sequence's own rules: which chosen tokens it keeps and why it ends."""

from __future__ import annotations

from app.engine.protocol import FinishReason
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
