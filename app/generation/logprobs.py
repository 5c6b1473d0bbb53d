"""A sequence's token log probabilities, carried with the text that shows each token.

The engine sends each generated token's log probabilities with the token
(`TokensOutput.logprobs`); the text of a token may be held back (a detokenizer's incomplete
character, text that may begin a stop string) and released with a later token's. So a
token goes out with the piece of text that completes its own: `add` takes each token, in
order, with the text the detokenizer released as it came (tokens that released none go
with the next text released, which completes them); `carried` the tokens whose text the
sequence has now sent; `rest` every other one, at the sequence's end (its final piece, or
the piece cut before a stop string, carries every token counted in `completion_tokens`,
the one that completed the stop string included, as vLLM reports them).

A sequence that ended at EOS (or a stop token id) on a completions route lists that token
last (`end`: `TokensOutput.end`), as OpenAI's legacy API and vLLM do; it shows no text, and
begins at the text's end.

Each token's `text_offset` is where its text begins in the sequence's text (tokens released
together begin where their text does), at most the text's length (a token cut away with a
stop string begins at its end). Front-end event loop thread; one instance per sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from app.engine.protocol import TokensOutput
from app.engine.protocol_logprobs import TokenLogprobs


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token, its log probabilities (None only for an echoed prompt's first token:
    `echo.py`), and where its text begins."""

    token_id: int
    text_offset: int
    logprobs: TokenLogprobs | None


class LogprobAligner:
    def __init__(self) -> None:
        self._held: list[tuple[int, TokenLogprobs]] = []  # no text released for them yet
        self._released: deque[tuple[TokenLogprob, int]] = deque()  # with their text's end
        self._produced = 0  # characters the detokenizer released
        self._sent = 0  # characters the sequence sent
        self._end: tuple[int, TokenLogprobs] | None = None  # listed last by `rest`

    def skip(self, characters: int) -> None:
        """The sequence's text begins with `characters` the generated tokens' do not hold
        (an echoed prompt: `echo.py`): their offsets begin after them."""
        self._produced += characters
        self._sent += characters

    def add(self, output: TokensOutput, position: int, text: str, pending: int = 0) -> None:
        """Token `position` of `output` (none past its last: an empty final output) was
        detokenized, releasing `text`, the detokenizer still holding the text of its last
        `pending` tokens (a release of held-back text may leave the last few held). Raises
        `TypeError` (a server fault) for an output without the log probabilities its
        request asked for."""
        if position < len(output.token_ids):
            logprobs = output.logprobs
            if logprobs is None or len(logprobs) != len(output.token_ids):
                raise TypeError("the engine sent tokens without their log probabilities")
            self._held.append((output.token_ids[position], logprobs[position]))
        if not text:
            return
        start, self._produced = self._produced, self._produced + len(text)
        completed = max(0, len(self._held) - pending)
        for token_id, token_logprobs in self._held[:completed]:
            released = TokenLogprob(token_id, start, token_logprobs)
            self._released.append((released, self._produced))
        del self._held[:completed]

    def end(self, token_id: int, logprobs: TokenLogprobs) -> None:
        """The token that ended the sequence at EOS (not in its text): `rest` lists it last,
        at the text's end."""
        self._end = (token_id, logprobs)

    def carried(self, text: str) -> tuple[TokenLogprob, ...]:
        """The sequence sends `text` next: the tokens whose text is now all sent."""
        self._sent += len(text)
        carried: list[TokenLogprob] = []
        while self._released and self._released[0][1] <= self._sent:
            carried.append(self._released.popleft()[0])
        return tuple(carried)

    def rest(self, text: str) -> tuple[TokenLogprob, ...]:
        """The sequence ends, sending `text` last: every token not carried yet."""
        self._sent += len(text)
        last = [token for token, _ in self._released]
        last += [TokenLogprob(token_id, self._produced, lp) for token_id, lp in self._held]
        if self._end is not None:
            last.append(TokenLogprob(self._end[0], self._sent, self._end[1]))
        self._released.clear()
        self._held.clear()
        self._end = None
        return tuple(
            token
            if token.text_offset <= self._sent
            else TokenLogprob(token.token_id, self._sent, token.logprobs)
            for token in last
        )


def carried(aligner: LogprobAligner | None, text: str, end: bool) -> tuple[TokenLogprob, ...]:
    """What a piece of `text` carries (`end`: the sequence's last); none without logprobs."""
    if aligner is None:
        return ()
    return aligner.rest(text) if end else aligner.carried(text)
