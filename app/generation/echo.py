"""Completions' `echo`: a choice's text begins with its prompt's, and with `logprobs`, its
log probabilities begin with the prompt tokens' (the engine's `TokensOutput.prompt_logprobs`,
tokens 1..L-1; the first token's are null, as OpenAI's legacy API and vLLM write them).

The prompt's text is what decoding it gives (a token-id prompt's too, as the completion's
text is decoded), released token by token by an `IncrementalDetokenizer`, so each prompt
token's `text_offset` is where its text begins in the echoed text (tokens released together
begin where their text does: `LogprobAligner`'s rule). Front-end event loop thread.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from app.engine.protocol_logprobs import TokenLogprobs
from app.generation.detokenize import Decode, IncrementalDetokenizer
from app.generation.logprobs import TokenLogprob


def echoed(
    decode: Decode,
    special_ids: Collection[int],
    prompt_ids: Sequence[int],
    prompt_logprobs: Sequence[TokenLogprobs] | None,
    asked: bool,
) -> tuple[str, tuple[TokenLogprob, ...]]:
    """The prompt's text, and when the front end `asked` for them (`prompt_logprobs`, the
    engine's) each prompt token with its log probabilities (None for the first) and offset.
    Raises `TypeError` (a server fault, 500) for log probabilities asked and not sent (an
    older engine drops the `SamplingParams` field it does not know: an echo without them
    would be a 200 whose sums are empty) or not one per prompt token after the first."""
    if not asked:
        return decode(list(prompt_ids)), ()
    if prompt_logprobs is None:
        raise TypeError("the engine sent no log probabilities of the prompt it was asked for")
    if len(prompt_logprobs) != len(prompt_ids) - 1:
        raise TypeError("the engine sent a prompt's log probabilities of another length")
    detokenizer = IncrementalDetokenizer(decode, (), special_ids)
    pieces: list[str] = []
    produced = 0
    held: list[int] = []  # prompt positions whose text is not released yet
    starts = [0] * len(prompt_ids)
    for position, token in enumerate(prompt_ids):
        held.append(position)
        text = detokenizer.add([token])
        if position == len(prompt_ids) - 1:
            text += detokenizer.flush()
        if not text:
            continue
        completed = max(0, len(held) - detokenizer.pending)
        for done in held[:completed]:
            starts[done] = produced
        del held[:completed]
        pieces.append(text)
        produced += len(text)
    for position in held:  # released no text (special tokens): they begin at the end
        starts[position] = produced
    logprobs: list[TokenLogprobs | None] = [None, *prompt_logprobs]
    tokens = zip(prompt_ids, starts, logprobs, strict=True)
    return "".join(pieces), tuple(TokenLogprob(t, s, lp) for t, s, lp in tokens)
