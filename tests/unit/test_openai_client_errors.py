"""What OpenAI's own client (and the wrappers built on it: LiteLLM, LangChain) makes of the
OpenAI routes' refusals and model listing, a front end in front of an engine double
(tests/support/edge.py): the exception class each status maps to is what a caller catches."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.edge import CHAT_TEMPLATE, front_end

MESSAGES = [{"role": "user", "content": "hello"}]


@contextlib.asynccontextmanager
async def openai_client(tmp_path: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    async with front_end(tmp_path) as (http, _, _):
        yield openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="none", http_client=http, max_retries=0
        )


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("chat", {"n": 2}, "n"),
        ("chat", {"logprobs": True}, "logprobs"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format.type"),
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tools",
        ),
        ("chat", {"extra_body": {"surprise": 1}}, "surprise"),
        ("completions", {"echo": True}, "echo"),
        ("completions", {"logprobs": 1}, "logprobs"),
        ("completions", {"prompt": [1, 2, 3]}, "prompt"),
        ("completions", {"max_tokens": "many"}, "max_tokens"),
        ("embeddings", {"input": [1, 2, 3]}, "input"),
        ("embeddings", {"encoding_format": "hex"}, "encoding_format"),
    ],
)
async def test_a_refused_field_is_a_bad_request_naming_it(
    tmp_path: Path, route: str, fields: dict[str, object], param: str
) -> None:
    """Every refused field was a 422, which the client raises as UnprocessableEntityError:
    a caller's `except BadRequestError` (OpenAI answers such a request 400) missed it."""
    async with openai_client(tmp_path) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            if route == "chat":
                chat: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, **fields}
                await client.chat.completions.create(**chat)
            elif route == "completions":
                completion: dict[str, Any] = {"model": "tiny", "prompt": "hi", **fields}
                await client.completions.create(**completion)
            else:
                embedding: dict[str, Any] = {"model": "minilm", "input": "hi", **fields}
                await client.embeddings.create(**embedding)
    assert refused.value.status_code == 400
    body = refused.value.body
    assert isinstance(body, dict)
    assert (body["type"], body["code"], body["param"]) == (
        "invalid_request_error",
        "invalid_request",
        param,
    ), body
