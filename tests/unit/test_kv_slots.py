"""The generation KV cache's pure policy: slots, what can never fit, waits for a slot."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from app.admission import RejectReason
from app.engine.kv_slots import (
    StepPrice,
    payload_problem,
    start_verdict,
    step_price,
    steps_until_start,
)
from app.engine.protocol import GeneratePayload, SamplingParams
from app.engine.slot_table import SlotTable
from app.model_queues import ModelWork


def test_slot_table_hands_out_lowest_free_slot_and_takes_back_only_held_ones() -> None:
    table = SlotTable(3)
    assert [table.take(), table.take()] == [0, 1]
    table.give(0)
    assert table.take() == 0
    assert table.take() == 2
    assert table.free == 0 and table.held == 3
    with pytest.raises(RuntimeError):
        table.take()
    table.give(1)
    with pytest.raises(ValueError):
        table.give(1)
    with pytest.raises(ValueError):
        table.give(7)


@dataclass(frozen=True)
class Limits:
    max_sequence_tokens: int
    vocab_size: int = 1000


def payload(prompt: int, new: int, **sampling: object) -> GeneratePayload:
    return GeneratePayload(list(range(prompt)), SamplingParams(max_new_tokens=new, **sampling))  # type: ignore[arg-type]


def test_a_sequence_that_can_never_fit_names_the_limit() -> None:
    assert payload_problem(payload(10, 22), Limits(32)) is None
    problem = payload_problem(payload(10, 23), Limits(32))
    assert problem is not None
    assert "33" in problem and "32" in problem and "generate_slot_tokens" in problem


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (payload(0, 4), "no tokens"),
        (payload(3, 0), "max_new_tokens"),
        (payload(3, 4, do_sample=True, temperature=0.0), "temperature"),
        (payload(3, 4, top_p=-0.1), "top_p"),
        (payload(3, 4, top_p=1.5), "top_p"),
        (payload(3, 4, top_k=-1), "top_k"),
        (payload(3, 4, logprobs=-1), "logprobs"),
        (payload(3, 4, logprobs=21), "logprobs"),
    ],
)
def test_invalid_sampling_is_named(bad: GeneratePayload, words: str) -> None:
    problem = payload_problem(bad, Limits(64))
    assert problem is not None and words in problem


def test_a_prompt_id_outside_the_model_s_embedding_is_refused() -> None:
    """A front end checks a token-id prompt against its tokenizer; a model whose embedding
    has fewer rows (a fine-tune that added tokens without resizing it) took the id, and on
    CUDA the lookup's device-side assert lost the device: every request failed."""
    limits = Limits(64, vocab_size=50)
    fits = GeneratePayload([0, 49], SamplingParams(max_new_tokens=1))
    assert payload_problem(fits, limits) is None
    for ids in ([1, 50], [-1, 2]):
        problem = payload_problem(GeneratePayload(ids, SamplingParams(max_new_tokens=1)), limits)
        assert problem is not None and "0 to 49" in problem


def test_greedy_ignores_temperature() -> None:
    assert payload_problem(payload(3, 4, temperature=0.0), Limits(64)) is None


def test_top_p_of_0_keeps_the_top_token_as_transformers_does() -> None:
    assert payload_problem(payload(3, 4, do_sample=True, top_p=0.0), Limits(64)) is None


def test_no_wait_while_a_slot_is_free_for_the_newcomer() -> None:
    assert steps_until_start([5, 9], free_slots=1, waiting_new_tokens=[]) == 0
    assert steps_until_start([], free_slots=0, waiting_new_tokens=[]) == 0


def test_wait_is_the_soonest_finish_once_the_queue_ahead_has_its_slots() -> None:
    # Two running (5 and 9 tokens left), no free slot: a newcomer waits 5 steps.
    assert steps_until_start([9, 5], free_slots=0, waiting_new_tokens=[]) == 5
    # One waiting ahead takes the slot freed at 5; the newcomer gets the one freed at 9.
    assert steps_until_start([9, 5], free_slots=0, waiting_new_tokens=[3]) == 8
    # The waiting one started at 5 and needs 3: it frees its slot at 8, before the other.
    assert steps_until_start([20, 5], free_slots=0, waiting_new_tokens=[3]) == 8
    # A free slot goes to the one waiting first.
    assert steps_until_start([7], free_slots=1, waiting_new_tokens=[4]) == 4


def test_the_budget_bounds_the_wait_for_a_slot_not_the_generation() -> None:
    # A 2 s generation behind a 50 ms wait fits a 100 ms budget.
    assert start_verdict(0.05, 2.0, deadline=10.0, now=0.0, max_queue_delay_s=0.1) is None
    refused = start_verdict(0.3, 0.1, deadline=10.0, now=0.0, max_queue_delay_s=0.1)
    assert refused is not None and refused.reason is RejectReason.QUEUE
    assert refused.retry_after_s == pytest.approx(0.2)


def test_the_deadline_must_hold_the_wait_and_the_generation() -> None:
    refused = start_verdict(0.0, 2.0, deadline=1.0, now=0.0, max_queue_delay_s=0.1)
    assert refused is not None and refused.reason is RejectReason.DEADLINE
    assert start_verdict(0.0, 0.5, deadline=1.0, now=0.0, max_queue_delay_s=0.1) is None


def test_steps_are_priced_with_the_other_models_turns_between_them() -> None:
    """Each step pays a turn of the other models while they have turns left (one in line
    ends a multi-step run after its current step); past them, steps alone."""
    assert StepPrice(0.01).tokens_within(0.405, 200) == 40
    assert StepPrice(0.01, turn_s=0.1, turns_s=5.0).tokens_within(0.405, 200) == 3
    # One turn left: it is paid once, then steps alone (0.3 + 0.1 <= 0.405).
    assert StepPrice(0.01, turn_s=0.1, turns_s=0.1).tokens_within(0.405, 200) == 30
    assert StepPrice(0.0).tokens_within(1.0, 7) == 7  # no step time yet: the room
    assert StepPrice(0.01).tokens_within(-1.0, 7) == 0


def test_a_price_counts_the_turns_left_after_those_the_wait_counted() -> None:
    works = {
        "tiny": ModelWork(0.0, 0.0, 0.01, batches_ahead=1, turns=3),
        "minilm": ModelWork(0.0, 1.0, 0.1, turns=5),
        "idle": ModelWork(0.0, 0.0, 0.0, turns=0),
    }
    price = step_price("tiny", works, 2, 0.01)
    # The wait counted 2 of minilm's 5 turns: 3 left, each 0.1 s over 2 compute slots.
    assert (price.step_s, price.turn_s) == (0.01, 0.05)
    assert price.turns_s == pytest.approx(0.15)
    assert step_price("tiny", None, 2, 0.01) == StepPrice(0.01)


def test_prompt_chunks_cost_a_step_and_a_turn_each_as_tokens_do() -> None:
    """Each of a long prompt's extra chunk steps pays a step and the other models' turn, as
    a decode step does."""
    price = StepPrice(0.01, turn_s=0.1, turns_s=5.0)
    assert price.seconds(8, prefill_steps=8) == pytest.approx(16 * 0.01 + 16 * 0.1)
    assert price.seconds(0, prefill_steps=3) == pytest.approx(3 * 0.01 + 3 * 0.1)


def test_a_long_prompt_s_chunks_share_the_other_models_turns_with_its_tokens() -> None:
    """The other models' turns left (0.3 s here) are paid once, by the prompt's 3 extra chunk
    steps and its tokens together: 0.03 + 0.3 + 67 x 0.01 fits 1 s. Priced as a wait
    first (0.33 s) and then fitted from zero, they were paid twice: 37 tokens."""
    price = StepPrice(0.01, turn_s=0.1, turns_s=0.3)
    assert price.tokens_within(1.0, 500, prefill_steps=3) == 67
    assert price.seconds(67, 3) <= 1.0 < price.seconds(68, 3)
    assert price.tokens_within(1.0, 50, prefill_steps=3) == 50  # at most the room
