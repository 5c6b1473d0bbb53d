"""The log probabilities of one step's chosen tokens, for the rows that asked for them
(`SamplingParams.logprobs`): the log-softmax of the raw logits, before the row's
temperature, top-k and top-p (vLLM's default), and the `logprobs` most likely tokens by
`torch.topk`. Rows that did not ask cost nothing but a look at their row; those that did,
one log-softmax over their logits, one top-k and two copies of the results to the host.

A prompt's own log probabilities (`SamplingParams.prompt_logprobs`, completions' `echo`)
come from the prefill's hidden states (`record_prompt_logprobs`): the head over every prompt
position but the last, in chunks of at most `PROMPT_CHUNK_ELEMENTS` logits (a prompt
prefilled in chunks over several steps: each chunk's positions, its last predicting the
next chunk's first token).

Pure torch; called on compute threads, after `sampling.choose_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from app.engine.protocol_logprobs import TokenLogprobs
from app.models.sampling import NO_TOKEN

if TYPE_CHECKING:
    from app.models.causal_lm import StepRow

# A token's position in its sequence -> its log probabilities (`StepRow.logprobs`).
LogprobSink = dict[int, TokenLogprobs]

# The most logits one chunk of a prompt's positions makes at once (float32: 64 MiB): a
# 2,048-token prompt at a 152k vocabulary would otherwise be a 1.2 GB tensor, and twice it
# with its log-softmax.
PROMPT_CHUNK_ELEMENTS = 2**24


def _best(
    log_probabilities: torch.Tensor, targets: torch.Tensor, top: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Each row's log probability of its target, and its `top` most likely ids and theirs."""
    own = log_probabilities.gather(1, targets.unsqueeze(1))  # (rows, 1)
    top = min(top, log_probabilities.shape[-1])
    if top <= 0:
        empty: list[list[int]] = [[] for _ in range(len(own))]
        return own.squeeze(1).tolist(), empty, [[] for _ in own]
    best = torch.topk(log_probabilities, top, dim=-1)
    values: list[list[float]] = torch.cat([own, best.values], dim=1).tolist()  # one copy
    return [v[0] for v in values], best.indices.tolist(), [v[1:] for v in values]


def record_prompt_logprobs(
    hidden: torch.Tensor,
    prompt: Sequence[int],
    top: int,
    sink: LogprobSink,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    vocabulary: int,
    chunk_elements: int = PROMPT_CHUNK_ELEMENTS,
    first: int = 0,
) -> None:
    """Put prompt token p's log probabilities (p = 1..len-1: the log-softmax of the logits
    after position p - 1, gathered at token p) and the `top` most likely tokens' in `sink` at
    position p; a step run again overwrites them. `hidden`: the prompt's hidden states
    (positions, width), at least len(prompt) - 1 of them; `logits_of`: the model's head and
    its logit transforms, float32 (what the last position's logits are made by), of
    `vocabulary` columns; `chunk_elements`: the most logits made at once (a chunk holds at
    least one position)."""
    count = len(prompt) - 1
    if count <= 0:
        return
    targets = torch.tensor(list(prompt[1:]), dtype=torch.int64, device=hidden.device)
    positions = max(1, chunk_elements // max(vocabulary, 1))
    for start in range(0, count, positions):
        end = min(count, start + positions)
        log_probabilities = torch.log_softmax(logits_of(hidden[start:end]).float(), dim=-1)
        own, top_ids, top_values = _best(log_probabilities, targets[start:end], top)
        for offset, logprob in enumerate(own):
            sink[first + start + offset + 1] = TokenLogprobs(
                logprob, top_ids[offset], top_values[offset]
            )


def record_logprobs(logits: torch.Tensor, rows: Sequence[StepRow], chosen: list[int]) -> None:
    """Put each asking row's chosen token's log probabilities in its sink, at the chosen
    token's position (its row's `start` plus the tokens fed): a step run again (a failed
    step's triage) overwrites what it wrote. `logits`: the step's (rows, vocab); `chosen`:
    its tokens (a row with `NO_TOKEN` gets nothing: it fails)."""
    asking = [
        index
        for index, row in enumerate(rows)
        if row.logprobs is not None
        and row.sampling.logprobs is not None
        and chosen[index] != NO_TOKEN
    ]
    if not asking:
        return
    if len(asking) < len(rows):
        logits = logits[torch.tensor(asking, device=logits.device)]
    log_probabilities = torch.log_softmax(logits.float(), dim=-1)
    picked = torch.tensor([chosen[i] for i in asking], device=logits.device)
    wanted = [rows[i].sampling.logprobs or 0 for i in asking]
    own, top_ids, top_values = _best(log_probabilities, picked, max(wanted))
    for number, index in enumerate(asking):
        row, count = rows[index], wanted[number]
        sink = row.logprobs
        assert sink is not None
        sink[row.start + len(row.token_ids)] = TokenLogprobs(
            own[number], top_ids[number][:count], top_values[number][:count]
        )
