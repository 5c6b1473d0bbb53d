"""Completions' `echo`: a choice's text begins with its prompt's, and with `logprobs`, its
log probabilities begin with the prompt tokens' (the engine's `TokensOutput.prompt_logprobs`,
tokens 1..L-1; the first token's are null, as OpenAI's legacy API and vLLM write them).

The prompt's text is what decoding it gives (a token-id prompt's too, as the completion's
text is decoded), released token by token by an `IncrementalDetokenizer`, so each prompt
token's `text_offset` is where its text begins in the echoed text (tokens released together
begin where their text does: `LogprobAligner`'s rule). That is ~2 decode calls a prompt
token, so it is computed once per prompt (`echo_text`: its `n` choices share it; only the
log probabilities are each choice's own, `echoed`), and off the event loop for a long prompt
(`ECHO_INLINE_MAX_TOKENS`). `echo_text` runs on any one thread; `echoed` is cheap;
`PromptEchoes` runs on the front end's event loop thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.engine.protocol_logprobs import TokenLogprobs
from app.generation.detokenize import Decode, IncrementalDetokenizer
from app.generation.logprobs import TokenLogprob
from app.tokenizer_pool import INLINE_TOKENIZE_MAX_CHARS

if TYPE_CHECKING:
    from app.generation.tokenizer import GenerationTokenizer
    from app.service import Service


# Prompts longer than this echo on the tokenizer pool, not the event loop: echoing with
# offsets costs ~6.5 us a token (tiny model's tokenizer, this VM, a throwaway script: 0.7 ms
# at 64 tokens, 6.6 ms at 1,024), so 64 tokens stall the loop about as long as a few hops to
# a thread, and an 8k-token prompt would stall it ~50 ms for every stream it serves.
ECHO_INLINE_MAX_TOKENS = 64


@dataclass(frozen=True, slots=True)
class EchoText:
    """A prompt's echoed text, and where each prompt token's text begins in it (only when
    its log probabilities are asked: () otherwise)."""

    text: str
    starts: tuple[int, ...] = ()


def echo_text(
    decode: Decode, special_ids: Collection[int], prompt_ids: Sequence[int], offsets: bool
) -> EchoText:
    """The prompt's text, and with `offsets` each prompt token's start in it (token by
    token, as the generated text is released). Any one thread."""
    if not offsets:
        return EchoText(decode(list(prompt_ids)))
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
    return EchoText("".join(pieces), tuple(starts))


def echoed(
    echo: EchoText,
    prompt_ids: Sequence[int],
    prompt_logprobs: Sequence[TokenLogprobs] | None,
    asked: bool,
) -> tuple[str, tuple[TokenLogprob, ...]]:
    """One choice's echo: the prompt's text (`echo`, from `echo_text`), and when the front
    end `asked` for them (`prompt_logprobs`, the engine's) each prompt token with its log
    probabilities (None for the first) and offset. Raises `TypeError` (a server fault, 500)
    for log probabilities asked and not sent (an older engine drops the `SamplingParams`
    field it does not know: an echo without them would be a 200 whose sums are empty) or not
    one per prompt token after the first."""
    if not asked:
        return echo.text, ()
    if prompt_logprobs is None:
        raise TypeError("the engine sent no log probabilities of the prompt it was asked for")
    if len(prompt_logprobs) != len(prompt_ids) - 1:
        raise TypeError("the engine sent a prompt's log probabilities of another length")
    if len(echo.starts) != len(prompt_ids):
        raise TypeError("the prompt's echo was made without its offsets")
    logprobs: list[TokenLogprobs | None] = [None, *prompt_logprobs]
    tokens = zip(prompt_ids, echo.starts, logprobs, strict=True)
    return echo.text, tuple(TokenLogprob(t, s, lp) for t, s, lp in tokens)


class PromptEchoes:
    """Each prompt's `EchoText` of one request, made once, starting now (while the engine
    computes), on the tokenizer pool for a prompt over `ECHO_INLINE_MAX_TOKENS` tokens (its
    cost is by tokens; `Service.run_tokenizer` decides by characters, so it is told which).
    No prompts: nothing is made (a request without `echo`). `close` once the request ends."""

    def __init__(
        self,
        service: Service,
        tokenizer: GenerationTokenizer,
        prompts: Sequence[Sequence[int]],
        offsets: bool,
    ) -> None:
        self._made = [
            asyncio.ensure_future(
                service.run_tokenizer(
                    0 if len(ids) <= ECHO_INLINE_MAX_TOKENS else INLINE_TOKENIZE_MAX_CHARS + 1,
                    None,  # not the request's tokenizing: its `tokenize` phase ran on the loop
                    echo_text,
                    tokenizer.decode,
                    tokenizer.special_token_ids,
                    ids,
                    offsets,
                )
            )
            for ids in prompts
        ]

    async def of(self, prompt: int) -> EchoText:
        """Prompt `prompt`'s echo. Shielded: a choice that ends (or is cancelled) while it
        waits does not cancel its siblings'."""
        return await asyncio.shield(self._made[prompt])

    def close(self) -> None:
        """Cancel what is still being made; an error no choice read is read here (a request
        that failed before any answer would log it as never retrieved)."""
        for made in self._made:
            made.cancel()
            if made.done() and not made.cancelled():
                made.exception()
