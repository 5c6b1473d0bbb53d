"""The row counts a generation step's linears run on (`app/models/token_buckets.py`): up to
the slot count as they are, over it the smallest power of two or 1.5 x power of two; and the
warm-up prefills reach every bucket a step within the limits pads to, each within them."""

from __future__ import annotations

import pytest
import torch

from app.models.token_buckets import bucket_prefills, padded_tokens, pads_tokens


def test_tokens_up_to_the_slot_count_are_not_padded_and_more_go_to_the_next_bucket() -> None:
    assert [padded_tokens(t, 32) for t in (1, 31, 32)] == [1, 31, 32]
    assert [padded_tokens(t, 32) for t in (33, 48, 49, 64, 65, 96, 97)] == [
        48,
        48,
        64,
        64,
        96,
        96,
        128,
    ]
    assert [padded_tokens(t, 4) for t in (5, 6, 7, 8, 9, 2047, 2048, 2049)] == [
        6,
        6,
        8,
        8,
        12,
        2048,
        2048,
        3072,
    ]


def test_only_a_cpu_pads() -> None:
    assert pads_tokens(torch.device("cpu"))
    assert not pads_tokens(torch.device("cuda"))


@pytest.mark.parametrize(
    ("slots", "row_tokens", "step_tokens"),
    [(32, 128, 2048), (8, 128, 512), (6, 24, 100), (4, 3, 100), (5, 7, 33), (3, 50, 50)],
)
def test_warm_up_prefills_reach_every_bucket_a_step_can_pad_to(
    slots: int, row_tokens: int, step_tokens: int
) -> None:
    """Every step of at most `slots` rows of at most `row_tokens`, rows x longest at most
    `step_tokens` (at least a row: the settings hold a chunk), pads to the slot count's
    sizes or a warmed bucket; each warm-up prefill is such a step, one a bucket."""
    shapes = bucket_prefills(slots, slots, row_tokens, step_tokens)
    warmed = [padded_tokens(rows * length, slots) for rows, length in shapes]
    assert len(set(warmed)) == len(warmed) and all(bucket > slots for bucket in warmed)
    for rows, length in shapes:
        assert 1 <= rows <= slots and 1 <= length <= row_tokens
        assert rows * length <= step_tokens
    reached = {
        padded_tokens(rows * length, slots)
        for rows in range(1, slots + 1)
        for length in range(1, row_tokens + 1)
        if rows * length <= step_tokens
    }
    assert {bucket for bucket in reached if bucket > slots} == set(warmed)
