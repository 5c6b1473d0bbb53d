"""Error types and codes on the real routes, a front end in front of an engine double
(tests/support/edge.py): OpenAI's types on the /v1 routes with the reason in `code`,
whoever answers (an exception handler, the route, the middleware, the engine), /infer's
own; a failure and a silent engine mid-stream as SSE error events; and a 504 that says
where the engine found the deadline passed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from app.batch_rerun import RERUN_DEADLINE_PASSED
from app.engine.protocol import Failure, FailureKind, FromEngine, Output, Submit, TokensOutput
from tests.support.edge import CONTEXT, front_end


async def test_the_openai_routes_answer_openai_s_type_with_the_reason_in_code(
    tmp_path: Path,
) -> None:
    """Answered by an exception handler, by the route itself (too many inputs, dimensions)
    and by the middleware (a wrong method): the same vocabulary; /infer keeps its own."""
    async with front_end(tmp_path) as (client, _, _):
        too_long = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": CONTEXT}
        )
        too_many = await client.post("/v1/embeddings", json={"model": "minilm", "input": ["a"] * 5})
        dimensions = await client.post(
            "/v1/embeddings", json={"model": "minilm", "input": "a", "dimensions": 3}
        )
        unknown = await client.post("/v1/completions", json={"model": "gpt-17", "prompt": "a"})
        invalid = await client.post("/v1/completions", json={"model": "tiny", "prompt": 5})
        method = await client.get("/v1/completions")
        native = await client.post("/infer", json={"model": "minilm", "inputs": ["a"] * 5})
    answers = {
        (r.status_code, r.json()["error"]["type"], r.json()["error"]["code"])
        for r in (too_long, too_many, dimensions, unknown, invalid, method)
    }
    assert invalid.status_code == 400  # OpenAI's status for a wrong type (was FastAPI's 422)
    assert answers == {
        (400, "invalid_request_error", "context_length_exceeded"),
        (413, "invalid_request_error", "too_many_inputs"),
        (400, "invalid_request_error", "invalid_request"),
        (404, "invalid_request_error", "model_not_found"),
        (405, "invalid_request_error", "method_not_allowed"),
    }
    assert native.status_code == 413
    assert native.json()["error"]["type"] == native.json()["error"]["code"] == "too_many_inputs"


async def test_a_refusal_by_the_engine_is_of_openai_s_type(tmp_path: Path) -> None:
    def queue_full(submit: Submit) -> FromEngine:
        return Failure(submit.request_id, FailureKind.REJECTED, "full", "queue", 1.0)

    async with front_end(tmp_path, queue_full) as (client, _, _):
        response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2}
        )
    assert response.status_code == 429
    assert response.json()["error"] == {
        "type": "rate_limit_exceeded",
        "message": "full",
        "param": None,
        "code": "queue",
    }


async def test_a_failure_mid_stream_is_an_event_of_openai_s_type(tmp_path: Path) -> None:
    def one_token_then_late(submit: Submit) -> list[FromEngine]:
        token = Output(submit.request_id, False, TokensOutput([2], 1), 0.0, 0.0)
        late = Failure(submit.request_id, FailureKind.DEADLINE, "deadline passed after 1 token")
        return [token, late]

    async with front_end(tmp_path, one_token_then_late) as (client, _, _):
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    events = json_events(response.content)
    assert events[-1] == {
        "error": {
            "type": "server_error",  # a 504 had it come before the stream began
            "message": "deadline passed after 1 token",
            "param": None,
            "code": "deadline",
        }
    }


async def test_an_engine_gone_silent_mid_stream_is_a_503_event_not_a_server_fault(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine silent past the request's deadline + `ANSWER_GRACE_S` is `EngineUnavailable`:
    503 `not_ready` before a stream starts, but mid-stream it was logged with a stack trace
    as a fault of the front end's and sent as a 500 `internal_error` event."""

    def one_token_then_silence(submit: Submit) -> FromEngine:
        return Output(submit.request_id, False, TokensOutput([2], 1), 0.0, 0.0)

    async with front_end(tmp_path, one_token_then_silence) as (client, _, engine):
        # Silent "past the deadline" at once: the token is read first, then the silence.
        engine.answer_grace_s = -1e6
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    events = json_events(response.content)
    assert events[0]["choices"][0]["text"].strip() == "hello"  # the stream had begun
    error = events[-1]["error"]
    assert (error["type"], error["code"]) == ("server_error", "not_ready"), error
    assert "did not answer by the request's deadline" in error["message"]
    assert "generation failed mid-stream" not in caplog.text


@pytest.mark.parametrize("path", ["/v2/models/minilm/infer", "/infer"])
async def test_a_deadline_answer_says_where_the_engine_found_it_passed(
    tmp_path: Path, path: str
) -> None:
    """The v2 route answered every 504 "deadline passed before the request was computed",
    whatever the engine said (a row too late for its run alone after its batch failed had
    left the queue: `batch_rerun.RERUN_DEADLINE_PASSED`)."""

    def late(submit: Submit) -> FromEngine:
        return Failure(submit.request_id, FailureKind.DEADLINE, RERUN_DEADLINE_PASSED)

    v2_text = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}
    body = {"inputs": [v2_text]} if path.startswith("/v2") else {"model": "minilm", "inputs": "hi"}
    async with front_end(tmp_path, late) as (client, _, _):
        response = await client.post(path, json=body)
    assert response.status_code == 504, response.text
    assert RERUN_DEADLINE_PASSED in response.text


def json_events(stream: bytes) -> list[Any]:
    """The JSON objects of a server-sent event stream, in order (`[DONE]` left out)."""
    return [
        orjson.loads(line[len(b"data: ") :])
        for line in stream.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
