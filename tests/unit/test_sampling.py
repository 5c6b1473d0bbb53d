"""Next-token choice: greedy, temperature, top-k and top-p, and seeded draws."""

from __future__ import annotations

import math

import torch

from app.engine.protocol import SamplingParams
from app.models.sampling import NO_TOKEN, choose_tokens, filter_logits, new_generator

LOGITS = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))


def kept(params: SamplingParams) -> set[int]:
    filtered = filter_logits(LOGITS, params)
    return {i for i, value in enumerate(filtered.tolist()) if not math.isinf(value)}


def test_top_k_keeps_the_k_most_likely() -> None:
    assert kept(SamplingParams(max_new_tokens=1, top_k=2)) == {1, 3}
    assert kept(SamplingParams(max_new_tokens=1, top_k=0)) == {0, 1, 2, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # 0.4 + 0.3 = 0.7 reaches 0.7; 0.4 alone does not reach 0.5.
    assert kept(SamplingParams(max_new_tokens=1, top_p=0.7)) == {1, 3}
    assert kept(SamplingParams(max_new_tokens=1, top_p=0.5)) == {1, 3}
    assert kept(SamplingParams(max_new_tokens=1, top_p=0.3)) == {1}  # at least the first
    assert kept(SamplingParams(max_new_tokens=1, top_p=0.0)) == {1}  # greedy, as transformers


def test_temperature_sharpens_or_flattens() -> None:
    cold = filter_logits(LOGITS, SamplingParams(max_new_tokens=1, temperature=0.5)).softmax(-1)
    hot = filter_logits(LOGITS, SamplingParams(max_new_tokens=1, temperature=2.0)).softmax(-1)
    assert cold[1] > 0.4 > hot[1]


def test_greedy_rows_take_the_argmax_and_sampled_rows_repeat_with_a_seed() -> None:
    logits = torch.stack([LOGITS, LOGITS])
    greedy = SamplingParams(max_new_tokens=1)
    sampled = SamplingParams(max_new_tokens=1, do_sample=True, temperature=3.0)
    draws = [
        choose_tokens(logits, [greedy, sampled], [new_generator(1), new_generator(seed)])
        for seed in (5, 5)
    ]
    assert draws[0] == draws[1]
    assert draws[0][0] == 1
    many = {choose_tokens(logits[1:], [sampled], [new_generator(seed)])[0] for seed in range(40)}
    assert len(many) > 2, "different seeds draw different tokens"


def test_top_k_one_sampling_is_greedy() -> None:
    params = SamplingParams(max_new_tokens=1, do_sample=True, top_k=1, temperature=5.0)
    for seed in range(10):
        assert choose_tokens(LOGITS.unsqueeze(0), [params], [new_generator(seed)]) == [1]


def test_greedy_takes_the_first_of_tied_maxima() -> None:
    """As argmax and model.generate do: a tie between the best tokens goes to the lowest id."""
    tied = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0], [3.0, 0.0, 3.0, 3.0, 1.0]])
    greedy = SamplingParams(max_new_tokens=1)
    generators = [new_generator(0), new_generator(0)]
    assert choose_tokens(tied, [greedy, greedy], generators) == [1, 0]


def test_a_sampled_row_with_nan_logits_does_not_fail_the_rows_beside_it() -> None:
    """torch.multinomial raises on NaN: the step's exception failed every sequence in it.
    The broken row gets no token (its argmax was the NaN's index: garbage)."""
    logits = torch.stack([LOGITS, torch.tensor([0.1, float("nan"), 0.3, 0.2, 0.0])])
    sample = SamplingParams(max_new_tokens=1, do_sample=True, seed=3)
    generators = [new_generator(3), new_generator(3)]
    chosen = choose_tokens(logits, [sample, sample], generators)
    alone = choose_tokens(LOGITS.unsqueeze(0), [sample], [new_generator(3)])
    assert chosen[0] == alone[0]  # the healthy row drew as it would have alone
    assert chosen[1] == NO_TOKEN


NAN = float("nan")
INF = float("inf")


def test_rows_without_a_finite_maximum_get_no_token_greedy_or_sampled() -> None:
    """An fp16 overflow makes a row all NaN: its argmax was token 0, so the sequence
    emitted token 0 until max_new_tokens, with no error. Rows beside it are unaffected."""
    broken = [
        [NAN] * 5,  # the overflow's NaN row
        [0.1, NAN, 0.3, 0.2, 0.0],  # NaN anywhere: argmax is the NaN's index
        [-INF] * 5,
        [0.1, INF, 0.3, 0.2, 0.0],  # overflowed logits
    ]
    logits = torch.tensor([LOGITS.tolist(), *broken])
    greedy = SamplingParams(max_new_tokens=1)
    sample = SamplingParams(max_new_tokens=1, do_sample=True, seed=3)
    for params in (greedy, sample):
        rows = len(logits)
        chosen = choose_tokens(logits, [params] * rows, [new_generator(3) for _ in range(rows)])
        alone = choose_tokens(LOGITS.unsqueeze(0), [params], [new_generator(3)])
        assert chosen == [alone[0]] + [NO_TOKEN] * len(broken), params
