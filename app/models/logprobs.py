"""The log probabilities of one step's chosen tokens, for the rows that asked for them
(`SamplingParams.logprobs`): the log-softmax of the raw logits, before the row's
temperature, top-k and top-p (vLLM's default), and the `logprobs` most likely tokens by
`torch.topk`. Rows that did not ask cost nothing but a look at their row; those that did,
one log-softmax over their logits, one top-k and two copies of the results to the host.

Pure torch; called on compute threads, after `sampling.choose_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from app.engine.protocol_logprobs import TokenLogprobs
from app.models.sampling import NO_TOKEN

if TYPE_CHECKING:
    from app.models.causal_lm import StepRow

# A token's position in its sequence -> its log probabilities (`StepRow.logprobs`).
LogprobSink = dict[int, TokenLogprobs]


def record_logprobs(logits: torch.Tensor, rows: Sequence[StepRow], chosen: list[int]) -> None:
    """Put each asking row's chosen token's log probabilities in its sink, at the chosen
    token's position (its row's `start` plus the tokens fed): a step run again (a failed
    step's triage) overwrites what it wrote. `logits`: the step's (rows, vocab); `chosen`:
    its tokens (a row with `NO_TOKEN` gets nothing: it fails)."""
    asking = [
        index
        for index, row in enumerate(rows)
        if row.logprobs is not None and chosen[index] != NO_TOKEN
    ]
    if not asking:
        return
    if len(asking) < len(rows):
        logits = logits[torch.tensor(asking, device=logits.device)]
    log_probabilities = torch.log_softmax(logits.float(), dim=-1)
    picked = torch.tensor([chosen[i] for i in asking], device=logits.device)
    own = log_probabilities.gather(1, picked.unsqueeze(1))  # (asking, 1)
    wanted = [rows[i].sampling.logprobs or 0 for i in asking]
    top = min(max(wanted), log_probabilities.shape[-1])
    top_ids: list[list[int]] = [[] for _ in asking]
    if top > 0:
        best = torch.topk(log_probabilities, top, dim=-1)
        own = torch.cat([own, best.values], dim=1)  # one copy to the host for both
        top_ids = best.indices.tolist()
    values: list[list[float]] = own.tolist()
    for number, index in enumerate(asking):
        row, count = rows[index], wanted[number]
        sink = row.logprobs
        assert sink is not None
        sink[row.start + len(row.token_ids)] = TokenLogprobs(
            values[number][0], top_ids[number][:count], values[number][1 : 1 + count]
        )
