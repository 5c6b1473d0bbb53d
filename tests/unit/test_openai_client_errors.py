"""What OpenAI's own client (and the wrappers built on it: LiteLLM, LangChain) makes of the
OpenAI routes' refusals, model listing and chat roles, a front end in front of an engine double
(tests/support/edge.py): the exception class each status maps to is what a caller catches."""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import AsyncIterator
from inspect import signature
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import openai
import pytest

from app.engine.protocol import (
    FinishReason,
    FromEngine,
    GeneratePayload,
    Output,
    Submit,
    TokensOutput,
)
from app.frontend_process import run_frontend_process
from app.processes import ProcessTree
from app.settings import Settings
from tests.support.edge import CHAT_TEMPLATE, front_end
from tests.support.process_tree import StandIn

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
        ("chat", {"n": 17}, "n"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format.type"),
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tools",
        ),
        ("chat", {"extra_body": {"surprise": 1}}, "surprise"),
        ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ("completions", {"echo": True, "logprobs": 6}, "logprobs"),
        # Text that may begin a stop string is held back, and matched on every token.
        ("completions", {"stop": "#" * 257}, "stop"),
        ("chat", {"stop": ["\n", "#" * 257]}, "stop[1]"),
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"prompt": ["hi", 1]}, "prompt"),  # token ids are served, not mixed
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


async def test_the_client_lists_and_retrieves_each_model_with_when_it_was_created(
    tmp_path: Path,
) -> None:
    """OpenAI's Model object requires `created`, which the list lacked, and
    `client.models.retrieve` got 404 `not_found` (no such route) for a served model."""
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    async with front_end(tmp_path, created=1_700_000_000) as (http, _, _):
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
        listed = (await http.get("/v1/models")).json()["data"]
        tiny = await client.models.retrieve("tiny")
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.models.retrieve("gpt-17")
    assert [(card["id"], card["created"]) for card in listed] == [
        ("tiny", 1_700_000_000),
        ("minilm", 1_700_000_000),
    ]
    assert tiny.model_dump(exclude_none=True) == {
        "id": "tiny",
        "object": "model",
        "created": 1_700_000_000,
        "owned_by": "steadyserve",
        "task": "generate",
    }
    body = unknown.value.body
    assert isinstance(body, dict) and (body["code"], body["param"]) == ("model_not_found", "model")


class SpawnRecorder:
    """The spawn context, recording each front end's arguments; no child starts."""

    def __init__(self) -> None:
        self.Pipe = multiprocessing.get_context("spawn").Pipe
        self.args: list[tuple[object, ...]] = []

    def Process(self, target: object, args: tuple[object, ...], name: str) -> StandIn:
        self.args.append(args)
        started = args[3]
        assert isinstance(started, Connection)

        class Child(StandIn):
            def start(self) -> None:
                started.close()  # as a child's end closes when it exits

        return Child(500 + len(self.args))


async def test_every_front_end_is_given_the_tree_s_start_as_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A front end restarted later says the same `created` as the others: the tree's start,
    not its own."""
    tree = ProcessTree(Settings(), tmp_path)
    spawned = SpawnRecorder()
    monkeypatch.setattr(tree, "_context", spawned)
    monkeypatch.setattr(tree, "_heard_frontend", lambda *heard: None)
    try:
        for index in (0, 1, 0):  # the third: front end 0 restarted
            tree._spawn_frontend(index)
    finally:
        tree._zmq.destroy(linger=0)
    assert abs(tree.created - time.time()) < 60
    given = [signature(run_frontend_process).bind(*args).arguments for args in spawned.args]
    assert [arguments["created"] for arguments in given] == [tree.created] * 3


# Knows OpenAI's roles of before `developer`; its words are the tiny vocabulary's
# (tests/support/edge.py: hello=2, world=3, again=4).
ROLE_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}again {% elif m['role'] == 'user' %}"
    "{{ m['content'] }} {% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% endfor %}"
)


def one_token(submit: Submit) -> FromEngine:
    assert isinstance(submit.payload, GeneratePayload)
    prompt = len(submit.payload.prompt_ids)
    return Output(submit.request_id, True, TokensOutput([2], prompt, FinishReason.LENGTH), 0, 0)


async def test_a_developer_message_reaches_the_model_as_its_instructions(tmp_path: Path) -> None:
    """The client's `developer` role was refused (400) by a template that knows `system`."""
    (tmp_path / "chat_template.jinja").write_text(ROLE_TEMPLATE)
    async with front_end(tmp_path, one_token) as (http, _, engine):
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
        answer = await client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "developer", "content": "anything"},
                {"role": "user", "content": "hello world"},
            ],
            max_completion_tokens=1,
        )
    assert answer.choices[0].finish_reason == "length"
    payload = engine.submitted[0].payload
    assert isinstance(payload, GeneratePayload) and payload.prompt_ids == [4, 2, 3]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": None},
        {"role": "user"},
        {"role": "system", "content": None},
        {"role": "tool", "tool_call_id": "call-1"},
    ],
)
async def test_a_message_without_content_is_refused_unless_the_assistant_s(
    tmp_path: Path, message: dict[str, object]
) -> None:
    """OpenAI allows null content only on an assistant's message (one that called tools);
    another's became an empty turn, served as if the client had sent one."""
    async with openai_client(tmp_path) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hello"}, message],  # type: ignore[list-item]
            )
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "messages[1].content", body
    assert f"a {message['role']} message" in body["message"], body


async def test_an_assistant_message_may_have_null_content(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    async with front_end(tmp_path, one_token) as (http, _, engine):
        body = {
            "model": "tiny",
            "max_tokens": 1,
            "messages": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "world"},
            ],
        }
        answer = await http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    payload = engine.submitted[0].payload
    assert isinstance(payload, GeneratePayload) and payload.prompt_ids == [2, 3]
