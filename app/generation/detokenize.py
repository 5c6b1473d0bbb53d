"""Token ids arriving a few at a time, turned into text pieces that never split a character.

A byte-level tokenizer can emit half of a multi-byte character in one token; decoding that
alone gives U+FFFD. As vLLM and TGI do, the text is decoded over a short window (from
`prefix_offset`) and a piece is released only once the window's text has grown and does not
end in an incomplete character; the decoded window's earlier part is subtracted, so a
tokenizer that drops a leading space at the start of a decode still yields the right text.
The window starts inside the prompt (its last `CONTEXT_TOKENS` tokens, as vLLM's does): a
SentencePiece tokenizer (Llama 2, Mistral) drops the leading space of whatever a decode
starts with, and the first generated word would lose the space that parts it from the
prompt. The pieces concatenate to `decode(context + ids)` less `decode(context)`. One
instance per sequence; any one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"

Decode = Callable[[Sequence[int]], str]

# Prompt tokens a sequence's text is decoded after.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0  # the window's start: text before it was released already
        self._read_offset = len(self._ids)  # tokens up to here are released as text

    def add(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens complete (possibly empty: held until it is stable)."""
        self._ids.extend(token_ids)
        if self._read_offset == len(self._ids):
            return ""
        released = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(released) or window.endswith(REPLACEMENT_CHARACTER):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window[len(released) :]

    def flush(self) -> str:
        """The text still held back, at the end of the sequence (an incomplete character
        stays as U+FFFD, as a full decode would show it)."""
        if self._read_offset == len(self._ids):
            return ""
        released = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return window[len(released) :]


class WholeText:
    """The `IncrementalDetokenizer` interface for a reader that wants the text only at the
    end: `add` keeps the ids and releases nothing, `flush` decodes them all once (the text
    the incremental pieces would have concatenated to). One instance per sequence."""

    def __init__(self, decode: Decode, prompt_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._context = list(prompt_ids[-CONTEXT_TOKENS:])
        self._ids: list[int] = []

    def add(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        return ""

    def flush(self) -> str:
        ids, self._ids = self._ids, []
        if not ids:
            return ""
        return self._decode(self._context + ids)[len(self._decode(self._context)) :]
