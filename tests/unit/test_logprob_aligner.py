"""`LogprobAligner`: a token's log probabilities go with the text that completes its own
(the scenarios through the real tokenizer and stop strings are in
tests/integration/generation_frontend/test_logprobs_text.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from app.engine.protocol import TokensOutput
from app.engine.protocol_logprobs import TokenLogprobs
from app.generation.detokenize import IncrementalDetokenizer
from app.generation.logprobs import LogprobAligner, TokenLogprob


def output(*ids: int) -> TokensOutput:
    return TokensOutput(list(ids), 3, None, [TokenLogprobs(-i / 10, [], []) for i in ids])


def carried_ids(tokens: tuple[TokenLogprob, ...]) -> list[tuple[int, int]]:
    return [(token.token_id, token.text_offset) for token in tokens]


def test_tokens_whose_text_is_held_go_with_the_text_that_completes_them() -> None:
    aligner = LogprobAligner()
    aligner.add(output(5, 6, 7), 0, "ab")
    aligner.add(output(5, 6, 7), 1, "")  # half a character: held by the detokenizer
    aligner.add(output(5, 6, 7), 2, "é!")
    assert carried_ids(aligner.carried("ab")) == [(5, 0)]
    assert carried_ids(aligner.carried("é")) == []  # "!" not sent yet (a stop may begin)
    assert carried_ids(aligner.carried("!")) == [(6, 2), (7, 2)]


def test_the_end_carries_every_token_left_within_the_text_sent() -> None:
    aligner = LogprobAligner()
    aligner.add(output(5, 6), 0, "abc")
    aligner.add(output(5, 6), 1, "")  # a special token: no text, ever
    assert carried_ids(aligner.carried("a")) == []
    # Cut at a stop string after "ab": both tokens, offsets within the text sent.
    assert carried_ids(aligner.rest("b")) == [(5, 0), (6, 2)]
    assert aligner.rest("") == ()


def test_an_empty_final_output_releases_the_held_text() -> None:
    aligner = LogprobAligner()
    aligner.add(output(5), 0, "")
    aligner.add(TokensOutput([], 3, None, []), 0, "\ufffd")  # flushed at the end
    assert carried_ids(aligner.rest("\ufffd")) == [(5, 0)]


def test_tokens_without_their_log_probabilities_are_a_server_fault() -> None:
    with pytest.raises(TypeError, match="without their log probabilities"):
        LogprobAligner().add(TokensOutput([5], 3), 0, "a")


def test_text_released_after_a_long_hold_carries_only_the_tokens_it_completes() -> None:
    """Ten lone continuation bytes (each decodes to U+FFFD), then "b": the detokenizer holds
    them, then releases all but its last few; every held token went with that release,
    before its own text was sent, and the next token's offset pointed into earlier text."""

    def decode(ids: Sequence[int]) -> str:  # a byte-level vocabulary: id i is byte i
        return bytes(ids).decode("utf-8", errors="replace")

    token_ids = [0x80] * 10 + [ord("b")]
    stream = TokensOutput(token_ids, 1, None, [TokenLogprobs(-1.0, [], []) for _ in token_ids])
    detokenizer = IncrementalDetokenizer(decode)
    aligner = LogprobAligner()
    sent = ""
    sent_by: dict[int, int] = {}  # position -> length of the text sent when it was carried
    offsets: dict[int, int] = {}
    position = 0
    for index in range(len(token_ids)):
        text = detokenizer.add([token_ids[index]])
        if index == len(token_ids) - 1:
            text += detokenizer.flush()
        aligner.add(stream, index, text, detokenizer.pending)
        sent += text
        carried = aligner.rest(text) if index == len(token_ids) - 1 else aligner.carried(text)
        for token in carried:
            sent_by[position], offsets[position] = len(sent), token.text_offset
            position += 1
    assert sent == decode(token_ids)
    assert sorted(sent_by) == list(range(len(token_ids)))
    for index in range(len(token_ids)):  # token i's text is character i
        assert sent_by[index] > index, f"token {index} went out before its text"
        assert offsets[index] <= index
