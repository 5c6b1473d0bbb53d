"""The seed of each sequence of a seeded request: one per (prompt, choice), derived from the
request's, so a seeded request is reproducible and no two of its sequences share draws."""

from __future__ import annotations

# An odd 64-bit constant (2**64 / the golden ratio): prompt i's seed is the request's plus i
# times it, so nearby seeds' prompts do not share draws (seed 7's second prompt is not seed 8's
# first) and no two prompts of a request do.
_SEED_STRIDE = 0x9E3779B97F4A7C15

# Choice j of prompt i is position j * _CHOICE_SPAN + i, below 2**32 for every prompt below
# _CHOICE_SPAN and choice below _CHOICES: torch's CPU generator (its Mersenne Twister) reads
# a seed's low 32 bits only, which differ for positions that differ below 2**32 (the stride
# is odd). Choice 0 is position i: `n` 1 keeps the seeds it always had.
_CHOICE_SPAN = 2**24
_CHOICES = 2**32 // _CHOICE_SPAN


def prompt_seed(seed: int | None, index: int) -> int | None:
    """The seed of the sequence at position `index`: the request's own for its first, one
    derived from it for the others, within int64 (the protocol's and torch's range). One
    seed for every prompt made a list of equal prompts come back as copies of one sample.
    Positions that differ below 2**32 get seeds whose low 32 bits differ (the stride is odd)."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_STRIDE + 2**63) % 2**64 - 2**63


def sequence_seed(seed: int | None, prompt: int, choice: int) -> int | None:
    """The seed of choice `choice` (0..n-1) of prompt `prompt`: `prompt_seed(seed, prompt)`
    for choice 0; no two (prompt, choice) pairs of a request share one, nor its low 32 bits,
    for prompts below _CHOICE_SPAN (a 1 MiB body holds ~350,000 empty prompts) and choices
    below _CHOICES (`MAX_CHOICES` is far below)."""
    return prompt_seed(seed, choice * _CHOICE_SPAN + prompt)
