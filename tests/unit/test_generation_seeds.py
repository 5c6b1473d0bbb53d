"""Each sequence of a seeded request gets a seed of its own (generation/seeds.py): choice
j of prompt i, with `n` choices per prompt; `n` 1 keeps the seeds served before `n`."""

from __future__ import annotations

import pytest

from app.generation import seeds
from app.generation.seeds import prompt_seed, sequence_seed
from app.schemas_choices import MAX_CHOICES


def old_prompt_seed(seed: int, index: int) -> int:
    """The seed of prompt `index` before `n` was served (pipeline.py's prompt_seed)."""
    if index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15 + 2**63) % 2**64 - 2**63


@pytest.mark.parametrize("seed", [0, 7, -3, 2**63 - 1, -(2**63)])
def test_choice_0_keeps_each_prompts_seed_of_before(seed: int) -> None:
    for prompt in range(40):
        assert sequence_seed(seed, prompt, 0) == old_prompt_seed(seed, prompt)
        assert prompt_seed(seed, prompt) == old_prompt_seed(seed, prompt)


@pytest.mark.parametrize("seed", [0, 7, -3, 2**63 - 1])
def test_no_two_sequences_of_a_request_share_a_seed(seed: int) -> None:
    drawn = [
        sequence_seed(seed, prompt, choice)
        for prompt in [*range(64), 2**24 - 1]
        for choice in range(MAX_CHOICES)
    ]
    # torch's CPU generator reads a seed's low 32 bits only: those must differ.
    assert len({s % 2**32 for s in drawn if s is not None}) == len(drawn)
    assert all(s is not None and -(2**63) <= s < 2**63 for s in drawn)


def test_an_unseeded_request_stays_unseeded() -> None:
    assert sequence_seed(None, 3, 2) is None


def test_the_cap_on_n_is_within_the_choices_seeds_tell_apart() -> None:
    assert MAX_CHOICES <= seeds._CHOICES


def test_seeds_draw_differently_in_torch() -> None:
    """The choices' seeds give torch's CPU generator different draws."""
    torch = pytest.importorskip("torch")
    draws = set()
    for choice in range(4):
        generator = torch.Generator().manual_seed(sequence_seed(11, 0, choice))
        draws.add(torch.rand(4, generator=generator).tolist().__repr__())
    assert len(draws) == 4
