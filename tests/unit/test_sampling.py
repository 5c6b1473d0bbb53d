"""Next-token choice: greedy, temperature, top-k and top-p, and seeded draws; the kept set
against a plain full-sort reference (Hugging Face's warpers) on large vocabularies."""

from __future__ import annotations

import math

import pytest
import torch

from app.engine.protocol import SamplingParams
from app.models import sampling
from app.models.sampling import (
    NO_TOKEN,
    _top_p_kept,
    choose_tokens,
    draw,
    kept_tokens,
    new_generator,
)

LOGITS = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))


def kept(params: SamplingParams) -> set[int]:
    ids, _ = kept_tokens(LOGITS, params)
    return set(ids.tolist())


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
    cold = kept_tokens(LOGITS, SamplingParams(max_new_tokens=1, temperature=0.5))[1].softmax(-1)
    hot = kept_tokens(LOGITS, SamplingParams(max_new_tokens=1, temperature=2.0))[1].softmax(-1)
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


def reference_kept(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Hugging Face's TopK then TopP warpers, over a full sort of the vocabulary: a stable
    one, so that of tokens tied at top-p's boundary the lowest ids stay (torch.sort's
    default leaves the order of ties unspecified past a few dozen elements)."""
    scaled = logits / max(params.temperature, 1e-5)
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True, stable=True)
        probabilities = ordered.softmax(-1)
        drop = (probabilities.cumsum(-1) - probabilities) >= params.top_p
        drop[0] = False
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
    return {i for i, value in enumerate(scaled.tolist()) if not math.isinf(value)}


def test_the_kept_set_is_the_full_sort_s_on_a_large_vocabulary() -> None:
    """Top-p looks at the tokens over TOP_P_FLOOR first: a peaked distribution's set lies
    within them, a flat one's does not (`_top_p_kept` cuts the range), and both must keep
    exactly what the warpers keep."""
    vocab = 4096
    generator = torch.Generator().manual_seed(7)
    peaked = torch.randn(vocab, generator=generator) * 6  # top-p's set: a few dozen tokens
    flat = torch.randn(vocab, generator=generator) * 0.1  # its set: most of the vocabulary
    cases = [
        SamplingParams(max_new_tokens=1, do_sample=True, temperature=t, top_p=p, top_k=k)
        for t in (0.5, 1.0, 1.7)
        for p in (0.0, 0.5, 0.9, 0.99, 1.0)
        for k in (0, 1, 40, vocab)
    ]
    sizes = set()
    for logits in (peaked, flat):
        for params in cases:
            kept_ids = kept_tokens(logits, params)[0].tolist()
            assert len(kept_ids) == len(set(kept_ids))
            assert set(kept_ids) == reference_kept(logits, params), params
            sizes.add(len(kept_ids) > vocab // 2)
    assert sizes == {True, False}, "both the likely tokens' and the cut range's paths ran"


def test_draws_follow_the_kept_distribution_and_never_leave_it() -> None:
    params = SamplingParams(max_new_tokens=1, do_sample=True, top_p=0.8)  # keeps 1, 3, 4
    kept_probabilities = {1: 0.4 / 0.85, 3: 0.3 / 0.85, 4: 0.15 / 0.85}
    draws = [draw(LOGITS, params, new_generator(seed)) for seed in range(4000)]
    assert set(draws) == set(kept_probabilities)
    for token, probability in kept_probabilities.items():
        assert abs(draws.count(token) / len(draws) - probability) < 0.03, token


def test_a_confident_step_does_not_sort_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """One token holds nearly all the mass (the most common step): the tokens over the floor
    already hold top_p, so top-p's set lies within them; the whole vocabulary was sorted
    whenever top-p kept every one of them, 4-19 ms a row at a 152k vocabulary."""
    vocab = 50_000
    generator = torch.Generator().manual_seed(3)
    confident = torch.randn(vocab, generator=generator) - 4
    confident[0] = 12.0  # p ~ 0.9994
    two = torch.randn(vocab, generator=generator) - 8
    two[0], two[1] = 12.0, 11.5  # ~0.62 and ~0.38
    cases = [
        (logits, SamplingParams(max_new_tokens=1, do_sample=True, temperature=0.8, top_p=top_p))
        for logits in (confident, two)
        for top_p in (0.0, 0.9, 0.95)
    ]
    expected = [reference_kept(logits, params) for logits, params in cases]  # full sorts
    sorted_sizes = recorded_sorts(monkeypatch)
    kept = [set(kept_tokens(logits, params)[0].tolist()) for logits, params in cases]
    assert kept == expected
    assert sorted_sizes and max(sorted_sizes) < vocab


def recorded_sorts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths of the tensors torch.sort is given from now on."""
    sorted_sizes: list[int] = []
    real_sort = torch.sort

    def recording_sort(values: torch.Tensor, *args: object, **kwargs: object) -> object:
        sorted_sizes.append(values.shape[-1])
        return real_sort(values, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "sort", recording_sort)
    return sorted_sizes


def test_a_flat_distribution_keeps_the_full_sort_s_set_without_sorting_the_vocabulary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """High temperature or top_p near 1: top-p's set reaches far past the tokens over the
    floor, and the whole vocabulary was sorted (14 ms a row at 152k tokens). Now the values'
    range is cut until few tokens are left to sort (a small band here, so that it is cut
    several times), with ties at the boundary (rounded logits) and -inf logits."""
    vocab = 4096
    monkeypatch.setattr(sampling, "TOP_P_BAND", 16)
    generator = torch.Generator().manual_seed(11)
    rows = []
    for row in range(24):
        logits = torch.randn(vocab, generator=generator) * (0.1, 0.5, 1.0, 2.0)[row % 4]
        if row % 3 == 1:
            logits = (logits * 32).round() / 32  # many tokens tied with the boundary's
        if row % 3 == 2:
            logits[torch.randperm(vocab, generator=generator)[: vocab // 3]] = -math.inf
        rows.append(logits)
    cases = [
        SamplingParams(max_new_tokens=1, do_sample=True, temperature=t, top_p=p)
        for t in (0.7, 1.5)
        for p in (0.0, 0.3, 0.8, 0.95, 0.99)
    ]
    checked = [(logits, p) for logits in rows for p in cases if not rounding_decides(logits, p)]
    assert len(checked) > 0.95 * len(rows) * len(cases)
    expected = [reference_kept(logits, params) for logits, params in checked]
    sorted_sizes = recorded_sorts(monkeypatch)
    for (logits, params), reference in zip(checked, expected, strict=True):
        kept_ids = kept_tokens(logits, params)[0].tolist()
        assert len(kept_ids) == len(set(kept_ids))
        assert set(kept_ids) == reference, params
    assert max(sorted_sizes) < vocab // 4, "no sort of (most of) the vocabulary"


def rounding_decides(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Whether a token's mass before it (in `reference_kept`'s order) is within float32's
    rounding of top_p, where any two ways of summing may disagree (tied tokens' masses
    step evenly, and a step can land there)."""
    probabilities = torch.sort(logits / params.temperature, descending=True).values.softmax(-1)
    before = probabilities.cumsum(-1) - probabilities
    return bool(((before[1:] - params.top_p).abs() < 1e-6).any())  # the first one stays


def test_the_cut_keeps_whole_bins_over_the_boundary_and_the_lowest_ids_of_its_ties(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bins over the boundary's are kept in id order, then the boundary's tokens most
    likely first: of five tied at 0.1, only the lowest id stays (0.3 + 0.2 + 0.1 reaches
    0.55); -inf logits fall in the lowest bin and are never kept; top_p 0 keeps the most
    likely token alone."""
    monkeypatch.setattr(sampling, "TOP_P_BAND", 2)
    probabilities = [0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.2, 0.0, 0.0]
    scaled = torch.tensor(probabilities).log()  # log(0) is -inf
    log_total = torch.logsumexp(scaled, -1)
    ids, values = _top_p_kept(scaled, log_total, 0.55)
    assert ids.tolist() == [0, 6, 1]
    assert torch.equal(values, scaled[ids])
    assert _top_p_kept(scaled, log_total, 0.95)[0].tolist() == [0, 6, 1, 2, 3, 4, 5]
    assert _top_p_kept(scaled, log_total, 1.0)[0].tolist() == [0, 6, 1, 2, 3, 4, 5]
    assert _top_p_kept(scaled, log_total, 0.0)[0].tolist() == [0]


def counted_bincounts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per torch.bincount call from now on (a pass of `_top_p_kept`'s cut)."""
    calls: list[int] = []
    real_bincount = torch.bincount

    def counting_bincount(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real_bincount(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "bincount", counting_bincount)
    return calls


def test_a_near_zero_temperature_keeps_the_tied_top_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Temperature 1e-5 over bf16 logits whose top two tie: divided unshifted, the values
    reached 2.5 million, float32's log-sum-exp rounded by a quarter, the two tokens' masses
    summed to 0.94 < top_p, and top-p kept the whole vocabulary (the full sort's set is
    the two), after 1,713 passes of the cut over it, seconds for one token."""
    vocab = 32_000
    logits = torch.linspace(-10, 24, vocab).to(torch.bfloat16).float()
    logits[[5, 9]] = 25.0
    params = SamplingParams(max_new_tokens=1, do_sample=True, temperature=1e-5, top_p=0.95)
    passes = counted_bincounts(monkeypatch)
    assert set(kept_tokens(logits, params)[0].tolist()) == reference_kept(logits, params)
    assert reference_kept(logits, params) == {5, 9}
    assert len(passes) <= 2


def test_a_mass_short_of_top_p_keeps_every_token_in_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When rounding leaves the whole mass short of top_p (top_p within float32's error
    of 1), every token has less than top_p before it: all are kept at once. The cut took
    the lowest bin as the boundary's at every level, 128 scaled units a pass."""
    monkeypatch.setattr(sampling, "TOP_P_BAND", 16)
    scaled = torch.linspace(-50_000, 0, 4096)
    short = torch.logsumexp(scaled, -1) + 0.1  # the masses now sum to e^-0.1 ~ 0.905
    passes = counted_bincounts(monkeypatch)
    ids, values = _top_p_kept(scaled, short, 0.95)
    assert sorted(ids.tolist()) == list(range(4096))
    assert torch.equal(values, scaled[ids])
    assert len(passes) == 1
