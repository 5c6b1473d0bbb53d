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

The window stays short: special tokens (which `decode` leaves out) never enter it, so a run
of them (a model emitting padding) does not re-decode a growing window at every step; and
tokens held back (a window ending in U+FFFD, or whose text did not grow) are released once
more than `MAX_HELD_TOKENS` wait, up to their last `INCOMPLETE_TOKENS` (all an incomplete
character can span), as a full decode shows them: a run of invalid bytes, or a model
writing U+FFFD itself, is not held to the end.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

REPLACEMENT_CHARACTER = "\ufffd"

Decode = Callable[[Sequence[int]], str]

# Prompt tokens a sequence's text is decoded after.
CONTEXT_TOKENS = 5
# The most tokens an incomplete character spans (its first 3 bytes of 4, a byte each), and
# the most tokens held back before those before them are released.
INCOMPLETE_TOKENS = 3
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(
        self, decode: Decode, prompt_ids: Sequence[int] = (), special_ids: Collection[int] = ()
    ) -> None:
        """`special_ids`: the tokens `decode` leaves out (the text is the same without)."""
        self._decode = decode
        self._special = frozenset(special_ids)
        self._ids: list[int] = self._text_ids(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0  # the window's start: text before it was released already
        self._read_offset = len(self._ids)  # tokens up to here are released as text

    def _text_ids(self, token_ids: Sequence[int]) -> list[int]:
        if not self._special:
            return list(token_ids)
        return [token for token in token_ids if token not in self._special]

    def add(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens complete (possibly empty: held until it is stable)."""
        self._ids.extend(self._text_ids(token_ids))
        if self._read_offset == len(self._ids):
            return ""
        released = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) > len(released) and not window.endswith(REPLACEMENT_CHARACTER):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return window[len(released) :]
        if len(self._ids) - self._read_offset <= MAX_HELD_TOKENS:
            return ""
        # Held too long: release all but the last tokens, whose text a later one may still
        # complete, once their text is where the window shows it (not cut mid-character).
        split = len(self._ids) - INCOMPLETE_TOKENS
        head = self._decode(self._ids[self._prefix_offset : split])
        if len(head) < len(released) or not window.startswith(head):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = split
        return head[len(released) :]

    @property
    def pending(self) -> int:
        """The tokens added whose text is still held back (the last ones added)."""
        return len(self._ids) - self._read_offset

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

    @property
    def pending(self) -> int:
        return len(self._ids)

    def flush(self) -> str:
        ids, self._ids = self._ids, []
        if not ids:
            return ""
        return self._decode(self._context + ids)[len(self._decode(self._context)) :]
