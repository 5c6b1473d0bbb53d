"""A generate request's messages in the engine protocol (`protocol.py`, which unions and
re-exports them): how a sequence continues its prompt, and the tokens it answers with.
Torch-free: front ends import this module.
"""

from __future__ import annotations

from enum import Enum

import msgspec

from app.engine.protocol_logprobs import EndToken, TokenLogprobs


class SamplingParams(msgspec.Struct, frozen=True):
    """How one sequence picks its next tokens. `do_sample` false: greedy (argmax), the rest
    ignored. `top_k` 0 and `top_p` 1.0 disable those filters. `seed` makes sampling
    reproducible per request. Stop *strings* are the front end's: it detokenizes the stream,
    and cancels the request once one appears; the engine stops at EOS, at one of
    `stop_token_ids` (a stop string naming a special token, which text never shows; ended
    as at EOS) or at `max_new_tokens`. `fit_to_deadline`: the client set no limit, and
    `max_new_tokens` is the room its prompt leaves; the engine lowers it to what the
    deadline leaves time for (the sequence then ends with `length`), instead of refusing a
    request that might well stop at EOS soon."""

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    fit_to_deadline: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # alternatives per token (`protocol_logprobs.py`); None: off
    prompt_logprobs: int | None = None  # the same per prompt token (completions' `echo`)


class GeneratePayload(msgspec.Struct, frozen=True, tag="generate"):
    """One prompt's token ids (the front end tokenized it, chat template applied) and how
    to continue it. A request with several prompts is several `Submit`s. `stream` false:
    nobody reads the text before the end (a whole answer, no stop strings to watch for),
    so the engine sends only the final output, with every token."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool = True


class FinishReason(Enum):
    EOS = "eos"  # EOS or one of `stop_token_ids` came (not in token_ids: `TokensOutput.end`)
    LENGTH = "length"  # max_new_tokens reached


class TokensOutput(msgspec.Struct, frozen=True, tag="tokens"):
    """New token ids since the previous output of this request (possibly none in the final
    one). The final output names why the sequence ended and counts its prompt tokens. The
    first output sent carries `prompt_logprobs`, when asked: prompt tokens 1..L-1's. A
    final output ending at EOS (or a stop token id) of a sequence asking `logprobs` carries
    that token and its log probabilities in `end` (not in `token_ids`: it is not generated
    text; completions list it last in a choice's logprobs). None from an older engine."""

    token_ids: list[int]
    prompt_tokens: int
    finish_reason: FinishReason | None = None  # set on the final output only
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when asked
    prompt_logprobs: list[TokenLogprobs] | None = None
    end: EndToken | None = None
