"""The errors the real routes answer about one text, a front end in front of an engine
double (tests/support/edge.py): which field an error names, as the client sent it (a
string or a list's index), for a text over the context or input limit, an input the
model fails on, and a lone surrogate refused before the tokenizer.

OpenAI's error types are tested in test_edge_openai_errors.py; the timing and refusal
counting of such requests in test_edge_accounting.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.engine.protocol import EmbedPayload, Failure, FailureKind, FromEngine, Submit
from tests.support.edge import CHAT_TEMPLATE, CONTEXT, front_end


@pytest.mark.parametrize(
    ("path", "body", "param", "named"),
    [
        (
            "/v1/completions",
            {"prompt": "hello world", "max_tokens": CONTEXT},
            "prompt",
            "the prompt",
        ),
        (
            "/v1/completions",
            {"prompt": ["hello", "hello world"], "max_tokens": 15},
            "prompt[1]",
            "prompt 1",
        ),
        ("/v1/completions", {"prompt": ["hello world"], "max_tokens": 15}, "prompt[0]", "prompt 0"),
        (
            "/infer",
            {"inputs": "hello", "parameters": {"max_new_tokens": CONTEXT}},
            "inputs",
            "the prompt",
        ),
        (
            "/infer",
            {"inputs": ["hello"], "parameters": {"max_new_tokens": CONTEXT}},
            "inputs[0]",
            "prompt 0",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": CONTEXT},
            "messages",
            "the prompt rendered from the messages",
        ),
    ],
)
async def test_an_error_about_one_text_names_it_as_the_client_sent_it(
    tmp_path: Path, path: str, body: dict[str, object], param: str, named: str
) -> None:
    """`prompt[0]` named an index into a field the client sent as one string, and so did
    the message ("prompt 0 has 2 tokens ..."), on every generation route; a list's prompt
    is still named by its index."""
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    async with front_end(tmp_path) as (client, _, _):
        response = await client.post(path, json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert error["message"].startswith(f"{named} has "), error
    assert f"at most {CONTEXT} tokens" in error["message"], error


# Over CONTEXT * MAX_CHARS_PER_TOKEN characters: refused before any tokenizer pass.
LONG_PROMPT = "hello " * 100


@pytest.mark.parametrize(
    ("path", "body", "param", "named"),
    [
        ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, "prompt", "the prompt"),
        ("/v1/completions", {"prompt": ["hello", LONG_PROMPT]}, "prompt[1]", "prompt 1"),
        ("/infer", {"inputs": LONG_PROMPT}, "inputs", "the prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": LONG_PROMPT}]},
            "messages",
            "the prompt rendered from the messages",
        ),
    ],
)
async def test_a_prompt_over_the_context_in_characters_is_context_length_exceeded(
    tmp_path: Path, path: str, body: dict[str, object], param: str, named: str
) -> None:
    """A prompt refused by its characters, before it is tokenized, was a 413 `input_too_long`
    where a shorter one over the same context was a 400 `context_length_exceeded`: a
    client's overflow handler (openai's BadRequestError, LiteLLM's context-window mapping)
    missed the longest prompts."""
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    async with front_end(tmp_path) as (client, _, engine):
        response = await client.post(path, json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert error["message"].startswith(f"{named} has "), error  # the rendered chat: 601
    assert f" characters; a sequence holds at most {CONTEXT} tokens" in error["message"], error
    assert engine.submitted == []


@pytest.mark.parametrize(("path", "field"), [("/v1/embeddings", "input"), ("/infer", "inputs")])
async def test_an_embedding_input_over_the_limit_in_characters_stays_a_413(
    tmp_path: Path, path: str, field: str
) -> None:
    """Only generation prompts are answered 400: an embedding input is `input_too_long`."""
    async with front_end(tmp_path) as (client, _, _):
        response = await client.post(path, json={"model": "minilm", field: LONG_PROMPT})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "input_too_long"


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        ({"input": "a b c d e"}, "input", "the input"),
        ({"input": ["a", "a b c d e"]}, "input[1]", "input 1"),
    ],
)
async def test_an_embedding_input_over_the_limit_is_named_as_sent(
    tmp_path: Path, body: dict[str, object], param: str, named: str
) -> None:
    """The message said "input 0 has ..." of an input sent as one string, as `param` once
    said `input[0]`."""
    async with front_end(tmp_path) as (client, _, _):
        response = await client.post("/v1/embeddings", json={"model": "minilm", **body})
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"{named} has "), error


LONE = "a\udc00"  # JSON may escape a lone surrogate; no tokenizer takes it (TypeError)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": LONE}, 400, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": ["hello", LONE]}, 400, "prompt[1]"),
        ("/v1/completions", {"model": "tiny", "prompt": "hello", "stop": [LONE]}, 400, "stop[0]"),
        ("/infer", {"model": "tiny", "inputs": LONE}, 422, "inputs"),
        ("/infer", {"model": "minilm", "inputs": [LONE]}, 422, "inputs[0]"),
        ("/v1/embeddings", {"model": "minilm", "input": LONE}, 400, "input"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": LONE}]},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}],
            },
            400,
            "messages",
        ),
    ],
)
async def test_a_lone_surrogate_in_any_text_is_refused_before_the_tokenizer(
    tmp_path: Path, path: str, body: dict[str, object], status: int, param: str
) -> None:
    """A guard, not a fix: the tokenizer raises TypeError on such a text (a 500). Every text
    field typed `NonEmptyText` is refused by pydantic's constrained-string check, which
    reads the text as UTF-8 (a plain `str` field is not); chat content, a plain `str`, is
    caught in the rendered prompt (`ChatTemplate.render`)."""
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    async with front_end(tmp_path) as (client, _, engine):
        response = await client.post(
            path,
            content=json.dumps(body).encode(),  # "\udc00" as JSON escapes it
            headers={"content-type": "application/json"},
        )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param), error
    assert engine.submitted == []


@pytest.mark.parametrize(
    ("body", "param"), [({"input": "a"}, "input"), ({"input": ["a", "b"]}, "input[1]")]
)
async def test_an_input_the_model_fails_on_is_a_400_naming_it(
    tmp_path: Path, body: dict[str, object], param: str
) -> None:
    index = 0 if param == "input" else 1

    def fails_on_one(submit: Submit) -> FromEngine:
        assert isinstance(submit.payload, EmbedPayload)
        message = f"the model could not process input {index} (IndexError)"
        return Failure(submit.request_id, FailureKind.BAD_REQUEST, message, input_index=index)

    async with front_end(tmp_path, fails_on_one) as (client, _, _):
        response = await client.post("/v1/embeddings", json={"model": "minilm", **body})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "type": "invalid_request_error",
        "message": f"the model could not process input {index} (IndexError)",
        "param": param,
        "code": "invalid_request",
    }
