"""Next-token choice from one step's logits: greedy, or sampled with temperature, top-k and
top-p (the semantics of Hugging Face's warpers), from a per-sequence seeded generator.

Pure torch; called on compute threads. Sampling runs on the CPU in float32 so that a seed
gives the same tokens on every device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from app.engine.protocol import SamplingParams

# Top-p first looks at the tokens at least this fraction as likely as the most likely one (a
# language model's next-token distribution almost always puts `top_p` of its mass there,
# a few dozen tokens), and sorts the whole vocabulary only when they might not hold it: a
# sort of a 150k vocabulary costs ~100x one pass over it on one CPU thread.
TOP_P_FLOOR = 1e-4
# Rounding room in that test: within it of top_p, the whole vocabulary is sorted.
TOP_P_MARGIN = 1e-6


def kept_tokens(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's float32 logits (vocab,) after temperature, top-k and top-p, as the kept
    tokens' ids and scaled logits (the semantics of Hugging Face's warpers: top-k keeps ties
    with the k-th; top-p then keeps the smallest set of most likely tokens whose
    probability, renormalised after top-k, reaches `top_p`, at least one); most likely
    first when top-k or top-p filtered, else every token in id order.

    Exact, and cheap for a large vocabulary: no sort without top-p; top-k sorts its k;
    top-p alone sorts the tokens over `TOP_P_FLOOR` and the whole vocabulary only when
    they hold less than `top_p` of the mass."""
    scaled = logits / max(params.temperature, 1e-5)
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k).values[-1]
        ids, values = _sorted_where(scaled, scaled >= kth)  # ties with the k-th stay
        log_total = torch.logsumexp(values, -1)
    elif params.top_p >= 1.0:
        return torch.arange(vocab), scaled
    else:
        log_total = torch.logsumexp(scaled, -1)
        # The most likely tokens (all those over a floor are): when they hold top_p of the
        # mass, the full sort's next token has top_p before it, so top-p's set lies within.
        ids, values = _sorted_where(scaled, scaled >= scaled.max() + math.log(TOP_P_FLOOR))
        held = float((values - log_total).exp().sum())
        if len(ids) < vocab and held < params.top_p + TOP_P_MARGIN:
            values, ids = torch.sort(scaled, descending=True)  # its set may go past them
    if params.top_p < 1.0:
        kept = _top_p_count(values, log_total, params.top_p)
        values, ids = values[:kept], ids[:kept]
    return ids, values


def _sorted_where(scaled: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids where `keep` holds and their `scaled` values, most likely first (a sort of
    those alone)."""
    ids = torch.nonzero(keep).squeeze(-1)
    values, order = torch.sort(scaled[ids], descending=True)
    return ids[order], values


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
