"""The text of a special token, in what a client sends: a stop string that is one ends the
sequence at that token (the text, which leaves special tokens out, never shows it). The
engine's side of such a stop: tests/unit/test_generation_sequence.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.engine.protocol import (
    FinishReason,
    FromEngine,
    GeneratePayload,
    Output,
    Submit,
    TokensOutput,
)
from app.generation.tokenizer import GenerationTokenizer
from tests.support.edge import CHAT_TEMPLATE, CONTEXT, front_end


def test_stop_strings_that_are_special_tokens_map_to_their_ids(tiny_causal_lm: Path) -> None:
    tokenizer = GenerationTokenizer(tiny_causal_lm, 512)
    eos, user = tokenizer.special_tokens["<|eos|>"], tokenizer.special_tokens["<|user|>"]
    assert tokenizer.stop_token_ids(["<|user|>", ".", "<|eos|>", "<|user|>"]) == (user, eos)
    assert tokenizer.stop_token_ids(["<|eos", "x<|eos|>"]) == ()
    assert eos in tokenizer.special_token_ids


def _ends_at_once(submit: Submit) -> FromEngine:
    return Output(submit.request_id, True, TokensOutput([2], 1, FinishReason.EOS), 0.0, 0.0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stop_string_that_is_a_special_token_goes_to_the_engine_as_its_id(
    tmp_path: Path, path: str
) -> None:
    """`stop: ["<s>"]` never matched: the decoded text leaves special tokens out, and the
    answer ran to max_tokens."""
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    text: dict[str, Any] = (
        {"prompt": "hello"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hello"}]}
    )
    body = {"model": "tiny", **text, "max_tokens": CONTEXT - 4, "stop": ["<s>", "again"]}
    async with front_end(tmp_path, _ends_at_once, special_tokens=["<s>"]) as (client, _, engine):
        response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    (submit,) = engine.submitted
    assert isinstance(submit.payload, GeneratePayload)
    assert submit.payload.sampling.stop_token_ids == (1,)  # "<s>"; "again" stays text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert response.json()["usage"]["completion_tokens"] == 1
