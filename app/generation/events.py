"""What the generation pipeline (`pipeline.py`) yields per sequence: pieces of text (with
their tokens' log probabilities, when asked) and one end, and the helpers that make a
sequence's last ones. Front-end event loop thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from app.generation.detokenize import IncrementalDetokenizer, WholeText
from app.generation.logprobs import LogprobAligner, TokenLogprob, carried

OpenAIFinish = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class TextPiece:
    """More text of sequence `index` (never part of a character, never past a stop), and
    the log probabilities of the tokens whose text it completes, when asked (`logprobs.py`:
    a sequence's last piece, possibly of no text, carries the rest)."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class SequenceEnd:
    """Sequence `index` ended; no more pieces of it follow. `choice`: which of its prompt's
    `n` sequences it is (usage counts a prompt's tokens once, with its choice 0)."""

    index: int
    finish_reason: OpenAIFinish
    prompt_tokens: int
    completion_tokens: int
    choice: int = 0


GenerationEvent = TextPiece | SequenceEnd


def decoded(
    detokenizer: IncrementalDetokenizer | WholeText, token_ids: Sequence[int], final: bool
) -> str:
    """The text new tokens release; at the end, with everything held back."""
    text = detokenizer.add(token_ids)
    return text + detokenizer.flush() if final else text


def last_events(
    index: int, text: str, end: SequenceEnd, aligner: LogprobAligner | None
) -> list[GenerationEvent]:
    """A sequence's last batch: its last piece (if any: text, or tokens left) and its end."""
    tokens = carried(aligner, text, end=True)
    return [TextPiece(index, text, tokens), end] if text or tokens else [end]
