"""Generation requests the front end refuses, and those that fail or are left, with the
tiny model's real tokenizer in front of a scripted engine (tests/support/
scripted_generator.py): a client's mistake is a 400 (422 on /infer) naming the field; a failure
mid-stream is an error event; a client that disconnects cancels its engine request."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI

from tests.support.generation import sse_payloads
from tests.support.generation_frontend import PROMPT, engine_of

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_chat_on_a_model_without_a_template_is_a_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "plain", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert "no chat template" in response.json()["error"]["message"]


async def test_a_route_asked_of_a_model_of_another_task_is_a_400(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/completions", json={"model": "minilm", "prompt": "hi"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    embedding = await client.post("/v1/embeddings", json={"model": "tiny", "input": "hi"})
    assert embedding.status_code == 400 and "does 'generate'" in embedding.text
    embedded = await client.post(
        "/infer", json={"model": "minilm", "inputs": "hi", "parameters": {"max_new_tokens": 3}}
    )
    assert embedded.status_code == 422  # an embedding request, validated as before
    assert embedded.json()["error"]["param"] == "parameters.max_new_tokens"


async def test_a_union_field_is_refused_for_what_is_wrong_with_the_member_sent(
    client: httpx.AsyncClient,
) -> None:
    """`stop` is a string or a list: 17 strings are refused for the list's length, not as
    "not a valid string", and the param is the field, without pydantic's member tag."""
    stops = [f"s{i}" for i in range(17)]
    response = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi", "stop": stops}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "stop"
    assert "at most 16 items" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
    ],
)
async def test_the_param_of_a_wrong_union_member_is_where_it_is_wrong(
    client: httpx.AsyncClient, body: dict[str, object], param: str
) -> None:
    """pydantic's member tag `str` passed for a field (`messages[0].content.str`), and the
    list's index was lost (`prompt` for `prompt[1]`)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = await client.post(path, json={"model": "tiny", **body})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


async def test_a_prompt_and_new_tokens_over_the_sequence_limit_is_a_400_naming_it(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 300}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    # OpenAI's type, the reason in `code`; the field as sent (one string: not `prompt[0]`).
    assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    assert "at most 256 tokens" in error["message"]


async def test_echo_with_max_tokens_0_at_the_limit_says_what_it_needs(
    client: httpx.AsyncClient,
) -> None:
    """A prompt of exactly the limit with `max_tokens` 0 and `echo`: the client asked for no
    new token, so the message must not say it asked for one ("asks for 1 more"); it says
    that echo needs room for the one the engine makes (and drops). One token less fits."""
    body = {"model": "tiny", "max_tokens": 0, "echo": True}
    at_limit = await client.post("/v1/completions", json={**body, "prompt": [5] * 256})
    assert at_limit.status_code == 400, at_limit.text
    error = at_limit.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"] == (
        "the prompt has 256 tokens; echo with max_tokens 0 needs room for one token after "
        "the prompt (computed, then dropped); a sequence holds at most 256 tokens (prompt + "
        "new tokens)"
    )
    fits = await client.post("/v1/completions", json={**body, "prompt": [5] * 255})
    assert fits.status_code == 200, fits.text
    # Too long alone: the plain message, asking for the 0 tokens the client asked for.
    over = await client.post("/v1/completions", json={**body, "prompt": [5] * 300})
    assert over.json()["error"]["message"] == (
        "the prompt has 300 tokens and asks for 0 more; a sequence holds at most 256 tokens "
        "(prompt + new tokens)"
    )


async def test_a_failure_mid_stream_is_an_error_event_then_done(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    engine = engine_of(app)
    engine.fail_after_tokens = 3
    try:
        response = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True},
        )
    finally:
        engine.fail_after_tokens = None
    chunks = sse_payloads(response.content)
    assert chunks[-1] == {
        "error": {
            "type": "server_error",
            "message": "internal server error",
            "param": None,
            "code": "internal_error",
        }
    }


async def test_a_client_that_disconnects_mid_stream_cancels_its_engine_request(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    engine = engine_of(app)
    body = orjson.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stream": True})
    statuses: list[int] = []
    first_text = asyncio.Event()
    sent: list[bytes] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await first_text.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
        if message["type"] == "http.response.body" and b'"text":"' in message.get("body", b""):
            sent.append(message["body"])
            first_text.set()

    path = "/v1/completions"
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("127.0.0.1", 1),
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
    }  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), 10)
    request_id = engine.submitted[-1].request_id
    assert statuses == [200] and sent, "the stream had started"
    assert request_id in engine.cancelled
    assert engine.running == 0
