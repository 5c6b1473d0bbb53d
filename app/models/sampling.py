"""Next-token choice from one step's logits: greedy, or sampled with temperature, top-k and
top-p (the semantics of Hugging Face's warpers), from a per-sequence seeded generator.

Pure torch; called on compute threads. Sampling runs on the CPU in float32 so that a seed
gives the same tokens on every device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.engine.protocol import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's float32 logits (vocab,) after temperature, top-k and top-p: tokens outside
    the kept set get -inf. Top-p keeps the smallest set of most likely tokens whose
    probability reaches `top_p` (at least one token)."""
    scaled = logits / max(params.temperature, 1e-5)
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = (cumulative - ordered.softmax(-1)) >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


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
    for row, row_params in enumerate(params):
        if not row_params.do_sample or chosen[row] == NO_TOKEN:
            continue
        filtered = filter_logits(logits[row].to("cpu", torch.float32), row_params)
        probabilities = filtered.softmax(-1)
        if not bool(torch.isfinite(probabilities).all()):
            continue  # finite logits past float32 once divided by the temperature: argmax
        chosen[row] = int(torch.multinomial(probabilities, 1, generator=generators[row]).item())
    return chosen
