"""Prefix reuse in the KV-cache slots (`slot_table.SlotTable`, pure): a joining prompt takes
the free slot whose resident tokens share its longest prefix and starts past them; and which
tokens a sequence leaves resident in its slot (`GenerationSequence.resident`), exactly those
whose keys and values its steps wrote. Before prefix reuse, `take` gave the lowest free slot
whatever a prompt was, and a sequence started at position 0: every test here fails there."""

from __future__ import annotations

import pytest

from app.engine.generation_batch import SequenceTable
from app.engine.protocol import SamplingParams
from app.engine.slot_table import MIN_REUSED_TOKENS, SlotTable, block_chain
from tests.support.stand_in_sequence import stand_in_sequence

GREEDY = SamplingParams(max_new_tokens=4)
PROMPT = tuple(range(100, 160))  # 60 tokens


def table_with(*residues: tuple[int, ...]) -> SlotTable:
    """Every slot free, slot i's resident tokens `residues[i]`."""
    table = SlotTable(len(residues), reuse=True)
    for slot in range(len(residues)):
        assert table.take() == slot
    for slot, resident in enumerate(residues):
        table.give(slot, resident)
    return table


def test_block_hashes_name_prefixes() -> None:
    tokens = tuple(range(100))
    chain = block_chain(tokens, 3)
    assert len(chain) == 3
    assert block_chain((*tokens[:40], -1), 2) == chain[:2]  # the same first 32 tokens
    assert block_chain((*tokens[:20], -1, *tokens[21:]), 3)[1:] != chain[1:]  # one differs
    assert block_chain((*tokens[:20], -1, *tokens[21:]), 3)[0] == chain[0]


def test_the_slot_sharing_the_longest_prefix_wins() -> None:
    other = (7,) * 40
    table = table_with(PROMPT[:20], (*PROMPT[:35], 1, 2), other, (*PROMPT[:25], 9))
    assert table.choose(PROMPT, GREEDY) == (1, 35)
    assert table.take(1) == 1 and table.free == 3
    assert table.choose(PROMPT, GREEDY) == (3, 25)


def test_a_tie_goes_to_the_lowest_slot() -> None:
    table = table_with((), (*PROMPT[:30], 1), (*PROMPT[:30], 2))
    assert table.choose(PROMPT, GREEDY) == (1, 30)


def test_below_the_minimum_nothing_is_reused_and_the_lowest_slot_is_taken() -> None:
    table = table_with((), PROMPT[: MIN_REUSED_TOKENS - 1])
    assert table.choose(PROMPT, GREEDY) == (0, 0)
    table = table_with((), PROMPT[:MIN_REUSED_TOKENS])
    assert table.choose(PROMPT, GREEDY) == (1, MIN_REUSED_TOKENS)
    # A prompt whose reuse is capped below the minimum (17 tokens: at most 16) reuses 16;
    # one of 16 tokens, at most 15: none.
    assert table.choose(PROMPT[: MIN_REUSED_TOKENS + 1], GREEDY) == (1, MIN_REUSED_TOKENS)
    assert table.choose(PROMPT[:MIN_REUSED_TOKENS], GREEDY) == (0, 0)


def test_reuse_leaves_the_prompt_s_last_token_to_be_fed() -> None:
    table = table_with((), (*PROMPT, 1, 2, 3))  # the whole prompt and more is resident
    assert table.choose(PROMPT, GREEDY) == (1, len(PROMPT) - 1)


def test_a_request_for_prompt_log_probabilities_never_reuses() -> None:
    table = table_with((), PROMPT)
    echo = SamplingParams(max_new_tokens=4, prompt_logprobs=0)
    assert table.choose(PROMPT, echo) == (0, 0)


def test_reuse_off_takes_the_lowest_slot() -> None:
    table = table_with((), PROMPT)
    table.reuse = False
    assert table.choose(PROMPT, GREEDY) == (0, 0)


def test_a_cleared_slot_has_no_residue_free_or_held() -> None:
    table = table_with((), PROMPT, PROMPT)
    table.forget(1)  # zeroed while free
    assert table.resident(1) == () and table.choose(PROMPT, GREEDY) == (2, 59)
    table.wrote(1, PROMPT)  # a late step's writes do not bring it back
    assert table.resident(1) == ()
    assert table.take(2) == 2
    table.forget(2)  # zeroed while held (non-finite logits, a failed step)
    table.give(2, PROMPT)  # its holder's record does not count
    assert table.resident(2) == () and table.choose(PROMPT, GREEDY) == (0, 0)
    assert table.take(2) == 2  # a fresh holder's record counts again
    table.give(2, PROMPT)
    assert table.resident(2) == PROMPT


def test_a_held_slot_is_not_rewritten_by_a_late_step() -> None:
    table = table_with((), PROMPT)
    assert table.take(1) == 1
    table.wrote(1, (5,) * 20)
    table.give(1, PROMPT[:30])
    assert table.resident(1) == PROMPT[:30]


async def test_a_joiner_starts_past_the_tokens_it_reuses_and_its_chunk_is_priced_so() -> None:
    """`SequenceTable.join` takes the chosen slot and sets `prefilled`; the step's prompt
    tokens (`max_batch_tokens`) count its chunk past the reused tokens."""
    table = SequenceTable(3, reuse=True)
    first = stand_in_sequence(4, prompt=PROMPT)
    first.chunk_tokens = 64
    table.queue(first)
    assert table.join(1000, 0.0) == [first] and first.slot == 0 and first.prefilled == 0
    first.chunk_computed()
    first.take([5, 6, 7, 8], frozenset())  # its length: 8, never fed
    table.remove(first)
    assert table.slots.resident(0) == (*PROMPT, 5, 6, 7)
    running = stand_in_sequence(4, prompt=(1,) * 40)
    running.chunk_tokens = 40
    joiner = stand_in_sequence(4, prompt=(*PROMPT[:50], 9, 9))
    joiner.chunk_tokens = 64
    table.queue(joiner)
    table.queue(running)
    # Two prompt rows, the longest 40 (the joiner's 2 tokens past its 50 reused): 80; its
    # whole prompt (52) would have left the other for the next step.
    assert table.join(80, 0.0) == [joiner, running]
    assert (joiner.slot, joiner.prefilled, running.slot) == (0, 50, 1)
    assert joiner.next_chunk() == 2 and joiner.prefill_steps() == 0
    assert joiner.row().start == 50 and list(joiner.row().token_ids) == [9, 9]


@pytest.mark.parametrize(
    ("chosen", "resident_tail"),
    [
        ([5, 6, 7, 8], (5, 6, 7)),  # its length: the last token is never fed
        ([5, 6, 2], (5, 6)),  # EOS (2) after 6: the step choosing it fed 6
        ([2], ()),  # EOS at once: only the prompt
    ],
)
async def test_a_sequence_leaves_resident_the_tokens_its_steps_fed(
    chosen: list[int], resident_tail: tuple[int, ...]
) -> None:
    sequence = stand_in_sequence(4, prompt=PROMPT, slot=0)
    sequence.chunk_tokens = 25
    assert sequence.resident() == ()
    sequence.chunk_computed()
    assert sequence.resident() == PROMPT[:25]  # a chunk computed
    sequence.chunk_computed()
    sequence.chunk_computed()
    for token in chosen:  # one a step, as single steps take them
        sequence.take([token], frozenset({2}))
    assert sequence.resident() == (*PROMPT, *resident_tail)


async def test_a_step_that_ran_after_its_sequence_left_counts_what_its_row_fed() -> None:
    sequence = stand_in_sequence(9, prompt=PROMPT, slot=0)
    sequence.chunk_tokens = 25
    sequence.chunk_computed()
    assert sequence.resident_after([]) == PROMPT[:50]  # mid-prefill: its next chunk
    sequence.chunk_computed()
    assert sequence.resident_after([5]) == PROMPT  # the last chunk: its token not fed
    sequence.chunk_computed()
    sequence.take([5], frozenset({2}))
    # A multi-step run fed 5, then each chosen token but the last (or its EOS).
    assert sequence.resident_after([6, 7, 8]) == (*PROMPT, 5, 6, 7)
    assert sequence.resident_after([6, 2]) == (*PROMPT, 5, 6)


def test_reusing_nothing_takes_a_slot_that_holds_nothing_before_one_holding_a_prefix() -> None:
    """Else a stranger's prompt took the lowest slot and wrote over the prefix the next
    request of a shared-prefix client would have reused."""
    stranger = tuple(range(500, 540))
    table = table_with(PROMPT[:40], (), PROMPT[:30])
    assert table.choose(stranger, GREEDY) == (1, 0)
    assert table.choose(stranger[:5], GREEDY) == (1, 0)  # too short to reuse: the same
    assert table_with(PROMPT[:40], PROMPT[:30]).choose(stranger, GREEDY) == (0, 0)  # given first


def test_a_hot_prefix_outlives_strangers_once_every_slot_holds_something() -> None:
    """With no empty slot, a stranger takes the slot given back longest ago: a client
    whose requests share a system prompt, alternating with strangers, keeps reusing it
    (the lowest free slot was the one it had just given back, so a stranger overwrote it
    every time and it never reused anything)."""
    table = table_with((9,) * 20, (8,) * 20, (7,) * 20)  # every slot holds something
    system = PROMPT
    for turn in range(4):
        slot, reused = table.choose(system, GREEDY)
        assert reused == (0 if turn == 0 else 59)
        table.give(table.take(slot), system[:59])
        stranger = tuple(range(1000 + 100 * turn, 1040 + 100 * turn))
        slot, reused = table.choose(stranger, GREEDY)
        assert reused == 0
        table.give(table.take(slot), stranger[:39])


def test_a_taken_or_forgotten_slot_is_no_longer_found_by_its_blocks() -> None:
    table = table_with(PROMPT[:40], PROMPT[:35])
    assert table.choose(PROMPT, GREEDY) == (0, 40)
    assert table.take(0) == 0
    assert table.choose(PROMPT, GREEDY) == (1, 35)
    table.forget(1)
    assert table.choose(PROMPT, GREEDY) == (1, 0)
    table.give(0, PROMPT[:20])  # its new holder's tokens replace its old ones
    assert table.choose(PROMPT, GREEDY) == (0, 20)


def test_a_block_hash_collision_is_not_taken_for_a_shared_prefix() -> None:
    table = table_with(PROMPT[:40], ())
    table._resident[0] = (-1,) * 40  # as if other tokens had hashed alike
    assert table.choose(PROMPT, GREEDY) == (1, 0)
