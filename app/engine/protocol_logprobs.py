"""The log probabilities a generate request may ask for, as the engine sends them with each
generated token (`TokensOutput.logprobs`; the front end names the tokens). Torch-free.

A token's log probability is the log-softmax of the model's raw next-token logits: before
the request's temperature, top-k and top-p (vLLM's default, "raw logprobs"), so a sampled
request reports the model's distribution, not the filtered one it drew from.
"""

from __future__ import annotations

import msgspec

# The most alternatives a request may ask for per token: OpenAI's chat limit (its legacy
# completions take at most 5, checked at the edge).
MAX_TOP_LOGPROBS = 20


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One generated token's log probability, and the `top` most likely tokens' (as many as
    asked: `SamplingParams.logprobs`), most likely first, as ids and log probabilities."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class EndToken(msgspec.Struct, frozen=True, array_like=True):
    """The token that ended a sequence at EOS (or one of its `stop_token_ids`), which is not
    kept as generated, and its log probabilities (`TokensOutput.end`)."""

    token_id: int
    logprobs: TokenLogprobs
