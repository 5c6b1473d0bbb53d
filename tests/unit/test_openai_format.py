"""OpenAI's completion objects as the generation routes build them: whole answers, stream
chunks (chat deltas, finish reasons, `usage: null` with include_usage, the usage chunk),
and the SSE frames they travel in, and the generated tokens' log probabilities in them.
The openai client parses these in tests/integration."""

from __future__ import annotations

import orjson
import pytest

from app.api.openai_format import (
    Reply,
    TextChunks,
    chunk,
    error_chunk,
    usage,
    usage_chunk,
    whole,
)
from app.api.openai_logprobs import LogprobRender
from app.api.sse import DONE, event
from app.engine.protocol_logprobs import TokenLogprobs
from app.generation.events import SequenceEnd
from app.generation.logprobs import TokenLogprob

ENDS = [SequenceEnd(0, "stop", 5, 3), SequenceEnd(1, "length", 7, 16)]


def test_a_whole_completion_has_a_choice_per_prompt_and_summed_usage() -> None:
    body = whole(Reply("tiny", chat=False), ["a", "b"], ENDS)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["text"] for c in body["choices"]] == ["a", "b"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 19, "total_tokens": 31}


def test_a_whole_chat_completion_answers_as_the_assistant() -> None:
    body = whole(Reply("tiny", chat=True), ["hi"], ENDS[:1])
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}


def test_chat_chunks_carry_deltas_the_first_naming_the_role() -> None:
    reply = Reply("tiny", chat=True)
    first = chunk(reply, 0, text="", role=True)
    middle = chunk(reply, 0, text="lo")
    last = chunk(reply, 0, finish_reason="length")
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert middle["choices"][0]["delta"] == {"content": "lo"}
    assert middle["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert {first["id"], middle["id"], last["id"]} == {reply.id}  # one id per stream
    assert "usage" not in middle


def test_with_include_usage_chunks_say_null_and_a_last_chunk_has_the_figures() -> None:
    reply = Reply("tiny", chat=False)
    assert chunk(reply, 1, text="x", with_usage=True)["usage"] is None
    final = usage_chunk(reply, ENDS)
    assert final["choices"] == [] and final["usage"] == usage(ENDS)
    assert final["object"] == "text_completion"


def test_sse_frames_are_single_data_lines_and_the_stream_ends_with_done() -> None:
    frame = event(chunk(Reply("tiny", chat=False), 0, text="two\nlines"))
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert frame.count(b"\n") == 2  # the text's newline is escaped inside the JSON
    assert orjson.loads(frame[len(b"data: ") : -2])["choices"][0]["text"] == "two\nlines"
    assert DONE == b"data: [DONE]\n\n"
    assert event(error_chunk(429, "queue", "full"))[6:-2] == (
        b'{"error":{"type":"rate_limit_exceeded","message":"full","param":null,"code":"queue"}}'
    )


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("with_usage", [False, True])
def test_a_text_chunk_from_its_template_is_the_event_of_the_chunk_byte_for_byte(
    chat: bool, with_usage: bool
) -> None:
    reply = Reply('model "with" quotes', chat=chat)
    chunks = TextChunks(reply, with_usage)
    for index in (0, 3, 0):
        for text in ("plain", "", 'quote " and \\ backslash', "line\nbreak", "🚀 你好", "\x00"):
            expected = event(chunk(reply, index, text=text, with_usage=with_usage))
            assert chunks.frame(index, text) == expected


# Token names: token 1 is "a", 2 is " b", 3 half of "é".
NAMES = {1: ("a", b"a"), 2: (" b", b" b"), 3: ("bytes:\\xc3", b"\xc3"), 4: (" b", b" b")}


class _Names:
    def named(self, token_id: int) -> tuple[str, bytes]:
        return NAMES[token_id]


def _tokens() -> list[TokenLogprob]:
    # Token 3 was chosen (sampled) outside the top 1; token 1 is -inf (ruled out).
    return [
        TokenLogprob(2, 0, TokenLogprobs(-0.5, [2, 1], [-0.5, -1.5])),
        TokenLogprob(3, 2, TokenLogprobs(-3.0, [1], [float("-inf")])),
    ]


def _render(chat: bool) -> LogprobRender:
    return LogprobRender(_Names(), chat)  # type: ignore[arg-type]


def test_completion_logprobs_hold_the_top_and_the_chosen_token_and_no_infinity() -> None:
    reply = Reply("tiny", chat=False, logprobs=_render(chat=False))
    body = whole(reply, ["text"], ENDS[:1], [_tokens()])
    assert body["choices"][0]["logprobs"] == {
        "tokens": [" b", "bytes:\\xc3"],
        "token_logprobs": [-0.5, -3.0],
        "top_logprobs": [{" b": -0.5, "a": -1.5}, {"a": -9999.0, "bytes:\\xc3": -3.0}],
        "text_offset": [0, 2],
    }
    assert whole(Reply("tiny", chat=False), ["text"], ENDS[:1])["choices"][0]["logprobs"] is None


def test_completion_top_logprobs_keep_the_likelier_of_two_ids_sharing_a_name() -> None:
    """Llama's "▁" and "<0x20>" are both " ": the dict keeps one entry per name, which was
    the last (less likely) alternative's."""
    reply = Reply("tiny", chat=False, logprobs=_render(chat=False))
    shared = [TokenLogprob(2, 0, TokenLogprobs(-0.5, [2, 4, 1], [-0.5, -0.9, -1.5]))]
    body = whole(reply, ["text"], ENDS[:1], [shared])
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{" b": -0.5, "a": -1.5}]


def test_chat_logprobs_are_a_content_list_with_bytes() -> None:
    reply = Reply("tiny", chat=True, logprobs=_render(chat=True))
    logprobs = whole(reply, ["text"], ENDS[:1], [_tokens()])["choices"][0]["logprobs"]
    assert logprobs == {
        "content": [
            {"token": " b", "logprob": -0.5, "bytes": [32, 98], "top_logprobs": [
                {"token": " b", "logprob": -0.5, "bytes": [32, 98]},
                {"token": "a", "logprob": -1.5, "bytes": [97]},
            ]},
            {"token": "bytes:\\xc3", "logprob": -3.0, "bytes": [0xC3], "top_logprobs": [
                {"token": "a", "logprob": -9999.0, "bytes": [97]},
            ]},
        ],
        "refusal": None,
    }  # fmt: skip


@pytest.mark.parametrize("chat", [False, True])
def test_a_text_chunk_with_logprobs_is_the_event_of_its_chunk(chat: bool) -> None:
    reply = Reply("tiny", chat=chat, logprobs=_render(chat))
    chunks = TextChunks(reply, with_usage=True)
    for tokens in (_tokens(), []):  # a piece whose tokens' text is not all sent yet: none
        expected = event(chunk(reply, 0, text="é", with_usage=True, tokens=tokens))
        assert chunks.frame(0, "é", tokens) == expected
        assert orjson.loads(expected[len(b"data: ") :])["choices"][0]["logprobs"] is not None
    final = chunk(reply, 0, finish_reason="stop")
    assert final["choices"][0]["logprobs"] is None
