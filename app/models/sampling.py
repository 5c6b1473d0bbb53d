"""Next-token choice from one step's logits: greedy, or sampled with temperature, top-k and
top-p (the semantics of Hugging Face's warpers), from a per-sequence seeded generator.

Pure torch; called on compute threads. Sampling runs on the CPU in float32 so that a seed
gives the same tokens on every device. No step sorts the vocabulary (a sort of 152k tokens
costs ~100x one pass over them on one CPU thread) unless top-k keeps most of it, or most
of it is tied at top-p's boundary: top-k sorts its k, top-p the tokens near
the most likely, or, when its set reaches past them (a flat distribution: high temperature,
top_p near 1), cuts the values' range into bins and sorts only the bin where its mass
reaches top_p (`_top_p_kept`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from app.engine.protocol import SamplingParams

# Top-p first looks at the tokens at least this fraction as likely as the most likely one (a
# language model's next-token distribution almost always puts `top_p` of its mass there,
# a few dozen tokens), and sorts them when they are at most `TOP_P_BAND` and hold it.
TOP_P_FLOOR = 1e-4
# Rounding room in that test: within it of top_p, `_top_p_kept` finds the set.
TOP_P_MARGIN = 1e-6
# Otherwise `_top_p_kept` cuts the values' range into this many bins, and the boundary's
# bin again, until at most `TOP_P_BAND` tokens are left to sort (a few passes over the
# vocabulary: ~3.8 ms a sampled row at 152k tokens, ~14 ms with a sort).
TOP_P_BINS = 1024
TOP_P_BAND = 2048


def kept_tokens(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's float32 logits (vocab,) after temperature, top-k and top-p, as the kept
    tokens' ids and scaled logits (the semantics of Hugging Face's warpers: top-k keeps ties
    with the k-th; top-p then keeps the smallest set of most likely tokens whose
    probability, renormalised after top-k, reaches `top_p`, at least one; of tokens tied at
    its boundary, the lowest ids, as a stable sort orders them). Every token in id order
    without a filter; most likely first after top-k, or top-p over the likely tokens; in
    id order then most likely first after `_top_p_kept`.

    Exact, and cheap for a large vocabulary: no sort without top-p; top-k sorts its k;
    top-p alone sorts the tokens over `TOP_P_FLOOR` when they are few and hold `top_p` of
    the mass, else finds its set in a few passes (`_top_p_kept`)."""
    scaled = logits / max(params.temperature, 1e-5)
    vocab = scaled.shape[-1]
    # Top-p's masses come from values shifted so the most likely is 0: at a near-zero
    # temperature the values reach millions, where float32's log-sum-exp rounds by a
    # quarter, and two tied tokens' masses summed to 0.94, not 1 (every step, and `draw`,
    # is shift-invariant; without top-p nothing sums masses, and nothing is shifted).
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k).values[-1]
        ids, values = _sorted(scaled, torch.nonzero(scaled >= kth).squeeze(-1))  # ties stay
        values = _shifted(values, values[0])  # the k kept: most likely first
        log_total = torch.logsumexp(values, -1)
    elif params.top_p >= 1.0:
        return torch.arange(vocab), scaled
    else:
        scaled = _shifted(scaled, scaled.max())  # in place: no second vocabulary's tensor
        log_total = torch.logsumexp(scaled, -1)
        # The most likely tokens (all those over a floor are): when they hold top_p of the
        # mass, the full sort's next token has top_p before it, so top-p's set lies within.
        likely = torch.nonzero(scaled >= scaled.max() + math.log(TOP_P_FLOOR)).squeeze(-1)
        if len(likely) > TOP_P_BAND:  # a flat distribution: too many to sort
            return _top_p_kept(scaled, log_total, params.top_p)
        ids, values = _sorted(scaled, likely)
        if float((values - log_total).exp().sum()) < params.top_p + TOP_P_MARGIN:
            return _top_p_kept(scaled, log_total, params.top_p)  # its set may go past them
    if params.top_p < 1.0:
        kept = _top_p_count(values, log_total, params.top_p)
        values, ids = values[:kept], ids[:kept]
    return ids, values


def _shifted(values: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """`values` less `top` (the largest of them, read before the subtraction), in place; as
    they are when `top` is not finite (a value overflowed once divided by the temperature:
    `draw` refuses the row)."""
    largest = float(top)
    if math.isfinite(largest):
        values -= largest
    return values


def _sorted(scaled: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids` and their `scaled` values, most likely first (a stable sort of those alone: of
    tied tokens, the lowest id first, as a stable full sort orders them)."""
    values, order = torch.sort(scaled[ids], descending=True, stable=True)
    return ids[order], values


def _top_p_kept(
    scaled: torch.Tensor, log_total: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p's kept tokens and their values (`_top_p_count`'s set over a stable full sort)
    without a sort of the vocabulary: the values' range is cut into `TOP_P_BINS` bins of
    equal width (a bin is a function of the value: tied tokens share one) and one pass sums
    each bin's mass; the bins over the one where the mass reaches `top_p` are kept whole
    (each token has less than `top_p` before it), those under it dropped (each has at
    least `top_p` before it), and that bin is cut again until at most `TOP_P_BAND` tokens
    are left, sorted: the mass over them plus their cumulative mass decides each. The
    whole bins' tokens in id order, then the last bin's, most likely first."""
    ids = torch.arange(len(scaled))
    values, probabilities = scaled, (scaled - log_total).exp()
    above = 0.0  # the mass of the tokens kept so far: all more likely than those left
    kept: list[torch.Tensor] = []
    while len(ids) > TOP_P_BAND:
        low, high = (float(bound) for bound in torch.aminmax(values))
        low = max(low, high - 128)  # exp underflows below: -inf logits join the lowest bin
        if not low < high:  # all tied
            break
        width = TOP_P_BINS / (high - low)
        bins = ((values - low) * width).clamp_(0, TOP_P_BINS - 1).int()  # monotone in value
        mass = torch.bincount(bins, weights=probabilities.double(), minlength=TOP_P_BINS)
        suffix = mass.flip(0).cumsum(0).flip(0)  # each bin's mass and the mass over it
        if above + float(suffix[0]) < top_p:
            # Rounding left the whole mass short of top_p (top_p within float32's error of
            # 1): every token has less before it, all stay. Cutting on would take the
            # lowest bin each time, 128 scaled units a pass: thousands of passes.
            return torch.cat([*kept, ids]), scaled[torch.cat([*kept, ids])]
        over = above + torch.cat([suffix[1:], torch.zeros(1, dtype=suffix.dtype)])
        cut = min(int((over >= top_p).sum()), TOP_P_BINS - 1)  # the lowest bin under top_p
        kept.append(ids[torch.nonzero(bins > cut).squeeze(-1)])
        above = float(over[cut])
        band = torch.nonzero(bins == cut).squeeze(-1)
        ids, values, probabilities = ids[band], values[band], probabilities[band]
    order = torch.sort(values, descending=True, stable=True).indices
    ids, probabilities = ids[order], probabilities[order]
    before = (above + probabilities.double().cumsum(-1)).float() - probabilities
    kept.append(ids[: int((before < top_p).sum())])
    kept_ids = torch.cat(kept)
    if not len(kept_ids):  # top_p <= 0: the most likely token alone
        kept_ids = ids[:1]
    return kept_ids, scaled[kept_ids]


def _top_p_count(values: torch.Tensor, log_total: torch.Tensor, top_p: float) -> int:
    """How many of the most likely tokens `values` (sorted, of a distribution whose log
    normaliser is `log_total`) top-p keeps: each one the tokens before which do not reach
    `top_p`, and at least the first."""
    probabilities = (values - log_total).exp()
    before = probabilities.cumsum(-1) - probabilities
    return max(1, int((before < top_p).sum()))


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one sequence: seeded when the request names a seed."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


NO_TOKEN = -1
"""`choose_tokens`' answer for a row whose logits have no finite maximum (NaN anywhere, +inf,
or every logit -inf): the model's arithmetic broke down (an fp16 overflow), so no token can
be chosen; the generation host fails that sequence instead of emitting garbage."""

NOT_CHOSEN = -2
"""`CausalLMRunner.step`'s answer for a row that chooses no token: a prompt's chunk that is
not its last (chunked prefill, `StepRow.next_prompt_token`)."""


def choose_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """The next token of each row of `logits` (rows, vocab): argmax for greedy rows, else a
    draw from the filtered distribution with the row's generator; `NO_TOKEN` for a row
    whose logits have no finite maximum (greedy or sampled: argmax of an all-NaN row is
    token 0, so such a sequence emitted token 0 until its length, with no error)."""
    # max(dim).indices is argmax (the first of tied maxima, as argmax and generate take it)
    # at half the cost of argmax over a step's rows on the CPU; max propagates NaN, so a
    # row holding one has a NaN maximum. tolist gives Python ints (one copy, as before).
    best = logits.max(dim=-1)
    chosen: list[int] = torch.where(torch.isfinite(best.values), best.indices, NO_TOKEN).tolist()
    sampled = [
        row
        for row, row_params in enumerate(params)
        if row_params.do_sample and chosen[row] != NO_TOKEN
    ]
    if not sampled:
        return chosen
    if logits.device.type == "cpu":
        rows = [logits[row].float() for row in sampled]  # views: no copy of the step's logits
    else:  # one copy of the sampled rows to the CPU (a device sync), not one per row
        rows = list(logits[sampled].to("cpu", torch.float32))
    for row, row_logits in zip(sampled, rows, strict=True):
        token = draw(row_logits, params[row], generators[row])
        if token != NO_TOKEN:
            chosen[row] = token
    return chosen


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """A token drawn from one row's kept tokens (`kept_tokens`) with `generator` (one uniform
    number, by inverse CDF over the kept set: no pass over the whole vocabulary as
    `torch.multinomial` makes); `NO_TOKEN` when the kept logits overflow float32 once
    divided by the temperature (the caller keeps the argmax)."""
    ids, values = kept_tokens(logits, params)
    cumulative = (values - values.max()).exp().cumsum(-1)  # each at most 1: no overflow
    total = cumulative[-1]
    if not math.isfinite(float(total)):  # a NaN anywhere ends the sum NaN
        return NO_TOKEN
    target = torch.rand((), generator=generator) * total
    index = min(int(torch.searchsorted(cumulative, target, right=True)), len(ids) - 1)
    return int(ids[index])
