"""What the OpenAI routes refuse rather than serve differently than asked (400)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.schemas_chat import MAX_CHAT_MESSAGES, MAX_CONTENT_PARTS
from app.schemas_generation import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateInferRequest,
)

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(("logprobs", "asked"), [(None, None), (0, 0), (1, 1), (5, 5), (2.0, 2)])
def test_completions_ask_for_0_to_5_alternatives(logprobs: object, asked: int | None) -> None:
    """`logprobs: 0` asks for the chosen tokens' log probabilities alone; a whole-number
    float is the integer, as the document's JSON Schema reads it."""
    request = CompletionRequest.model_validate({"prompt": "Hi", "logprobs": logprobs})
    assert request.logprobs_asked() == asked


@pytest.mark.parametrize("logprobs", [6, -1, True, False, 1.5, "1"])
def test_completions_refuse_other_logprobs(logprobs: object) -> None:
    with pytest.raises(ValidationError, match="logprobs"):
        CompletionRequest.model_validate({"prompt": "Hi", "logprobs": logprobs})


def test_echo_asks_for_the_prompt_s_log_probabilities_with_logprobs() -> None:
    """Echo was refused (the prompt's log probabilities were not computed)."""
    asked = CompletionRequest.model_validate({"prompt": "Hi", "echo": True, "logprobs": 1})
    assert asked.echo and asked.prompt_logprobs_asked() == 1 and asked.logprobs_asked() == 1
    text_only = CompletionRequest.model_validate({"prompt": "Hi", "echo": True})
    assert text_only.prompt_logprobs_asked() is None and text_only.logprobs_asked() is None
    unechoed = CompletionRequest.model_validate({"prompt": "Hi", "logprobs": 2})
    assert unechoed.prompt_logprobs_asked() is None
    for echo in (False, None):
        assert not CompletionRequest.model_validate({"prompt": "Hi", "echo": echo}).echo


def test_max_tokens_0_only_with_echo() -> None:
    """OpenAI's legacy echo request (older lm-eval-harness): the prompt alone."""
    request = {"prompt": [1, 2], "echo": True, "logprobs": 0, "max_tokens": 0}
    assert CompletionRequest.model_validate(request).max_tokens == 0
    with pytest.raises(ValidationError, match="0 only with echo"):
        CompletionRequest.model_validate({"prompt": "Hi", "max_tokens": 0})
    with pytest.raises(ValidationError, match="max_tokens"):
        CompletionRequest.model_validate({"prompt": "Hi", "echo": True, "max_tokens": -1})


@pytest.mark.parametrize("route", ["completions", "chat", "infer"])
def test_16_stop_strings_are_taken_and_17_refused(route: str) -> None:
    """lm-eval-harness sends every `until` string of a task: 5 were refused (at most 4)."""

    def validate(count: int) -> object:
        stops = [f"stop {i}" for i in range(count)]
        if route == "completions":
            return CompletionRequest.model_validate({"prompt": "Hi", "stop": stops})
        if route == "chat":
            return ChatCompletionRequest.model_validate({"messages": MESSAGES, "stop": stops})
        return GenerateInferRequest.model_validate({"inputs": "Hi", "parameters": {"stop": stops}})

    for count in (5, 16):
        assert validate(count)
    with pytest.raises(ValidationError, match="at most 16 items"):
        validate(17)


@pytest.mark.parametrize(
    ("fields", "asked"),
    [
        ({}, None),
        ({"logprobs": None}, None),
        ({"logprobs": False}, None),
        ({"logprobs": False, "top_logprobs": 0}, None),
        ({"top_logprobs": 0}, None),  # asks for nothing, as before logprobs were served
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 0}, 0),
        ({"logprobs": True, "top_logprobs": 20}, 20),
    ],
)
def test_chat_asks_with_logprobs_true_and_0_to_20_top_logprobs(
    fields: dict[str, object], asked: int | None
) -> None:
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})
    assert request.logprobs_asked() == asked


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"logprobs": False, "top_logprobs": 1}, "top_logprobs needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "less than or equal to 20"),
        ({"logprobs": True, "top_logprobs": -1}, "greater than or equal to 0"),
        ({"logprobs": 1}, "valid boolean"),
        ({"logprobs": 0}, "valid boolean"),
    ],
)
def test_chat_refuses_other_logprobs(fields: dict[str, object], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def test_stream_options_without_a_stream_are_refused() -> None:
    options = {"include_usage": True}
    with pytest.raises(ValidationError, match="only allowed when stream is true"):
        CompletionRequest.model_validate({"prompt": "Hi", "stream_options": options})
    streamed = {"prompt": "Hi", "stream": True, "stream_options": options}
    assert CompletionRequest.model_validate(streamed).include_usage


NO_OP_CHAT_FIELDS = [
    {"tools": None},
    {"tools": []},
    {"tool_choice": "none"},
    {"parallel_tool_calls": None},
    {"response_format": {"type": "text"}},
    {"logit_bias": {}},
    {"top_logprobs": 0},
    {"top_logprobs": None},
    # Change nothing about the answer; the openai client sends them where its caller does.
    {"store": False},
    {"store": None},
    {"metadata": {"job": "eval-7"}},
    {"service_tier": "auto"},
    {"safety_identifier": "user-1"},
    {"prompt_cache_key": "eval"},
]


@pytest.mark.parametrize("field", NO_OP_CHAT_FIELDS)
def test_unserved_fields_at_their_no_op_value_are_accepted(field: dict[str, object]) -> None:
    """Wrappers send these at their defaults; each was a 422 (unknown field)."""
    assert ChatCompletionRequest.model_validate({"messages": MESSAGES, **field})


@pytest.mark.parametrize(
    "field",
    [
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"tool_choice": "auto"},
        {"response_format": {"type": "json_object"}},
        {"logit_bias": {"50256": -100}},
        {"top_logprobs": 2},
        {"store": True},  # nothing is stored: it could never be retrieved
        {"service_tier": "flex"},
        {"metadata": {"k": 1}},
    ],
)
def test_unserved_fields_asking_for_something_are_refused(field: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, **field})


@pytest.mark.parametrize(
    "field",
    [
        {"max_tokens": True},
        {"max_tokens": "3"},
        {"temperature": "0.5"},
        {"seed": 1.5},
        {"n": True},
        {"presence_penalty": False},
    ],
)
def test_a_value_of_another_json_type_is_refused_not_converted(field: dict[str, object]) -> None:
    """Lax validation served `"max_tokens": true` as 1 token (and `n: true` passed as 1);
    a whole-number float is an integer (tests/integration/generation_frontend/
    test_openapi_document.py)."""
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "Hi", **field})
    assert CompletionRequest.model_validate({"prompt": "Hi", "temperature": 1}).temperature == 1.0


def test_too_many_messages_are_refused_before_any_is_validated() -> None:
    """A 1 MiB body holds ~34,000 messages: validating each (and templating them) held the
    event loop for a quarter of a second before the prompt was found too long."""
    unvalidated = [{}] * (MAX_CHAT_MESSAGES + 1)  # no role: each would be an error
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate({"messages": unvalidated})
    assert [e["msg"] for e in refused.value.errors()] == [
        f"Value error, at most {MAX_CHAT_MESSAGES} messages (got {MAX_CHAT_MESSAGES + 1})"
    ]
    at_the_cap = [{"role": "user", "content": "Hi"}] * MAX_CHAT_MESSAGES
    assert ChatCompletionRequest.model_validate({"messages": at_the_cap})


def test_too_many_content_parts_are_refused() -> None:
    parts = [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)
    with pytest.raises(ValidationError, match=f"at most {MAX_CONTENT_PARTS} content parts"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
