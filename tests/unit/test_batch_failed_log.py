"""A failed batch fails every request in it: each is answered the same 500 as any fault of
the server's, but logged in one line at most every `BATCH_FAILED_LOG_INTERVAL_S`, without a
traceback (the engine logged the batch's, once). It reached `ServerTimingMiddleware`'s
`log.exception` once per request (and a stream's, once per stream): a batch of 64 failing
inputs wrote 64 tracebacks of the front end's own, none of them the model's."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.api.errors import BATCH_FAILED_LOG_INTERVAL_S
from app.engine.protocol import Failure, FailureKind, FromEngine, Output, Submit, TokensOutput
from app.log_limits import Throttle
from tests.support.edge import front_end
from tests.unit.test_edge_openai_errors import json_events

CLOCK = [0.0]
FAULT = "RuntimeError('CUDA out of memory')"  # what the engine says of the batch's failure


@pytest.fixture(autouse=True)
def fresh_throttle(monkeypatch: pytest.MonkeyPatch) -> None:
    CLOCK[0] = 0.0
    monkeypatch.setattr(
        "app.api.errors._batch_failures", Throttle(BATCH_FAILED_LOG_INTERVAL_S, lambda: CLOCK[0])
    )


def batch_failed(submit: Submit) -> FromEngine:
    return Failure(submit.request_id, FailureKind.FAILED, FAULT)


def one_token_then_failure(submit: Submit) -> list[FromEngine]:
    token = Output(submit.request_id, False, TokensOutput([2], 1), 0.0, 0.0)
    return [token, batch_failed(submit)]


def error_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_the_requests_of_a_failed_batch_get_one_line_and_no_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        async with front_end(tmp_path, batch_failed) as (client, _, _):
            answers = [
                await client.post("/infer", json={"model": "minilm", "inputs": "hello"})
                for _ in range(3)
            ]
            openai = await client.post("/v1/embeddings", json={"model": "minilm", "input": "a"})
            CLOCK[0] += BATCH_FAILED_LOG_INTERVAL_S
            last = await client.post("/infer", json={"model": "minilm", "inputs": "hello"})
    for answer in [*answers, last]:
        assert answer.status_code == 500
        assert answer.json() == {
            "error": {
                "type": "internal_error",
                "message": "internal server error",
                "param": None,
                "code": "internal_error",
            }
        }
        assert "server-timing" in answer.headers
    assert openai.status_code == 500
    assert openai.json()["error"]["code"] == "internal_error"
    lines = error_lines(caplog)
    assert [r.exc_info for r in lines] == [None, None]
    assert [r.getMessage() for r in lines] == [
        f"batch failed, 500 to POST '/infer': {FAULT}",
        f"batch failed, 500 to POST '/infer': {FAULT}; 3 more since the last such line",
    ]


async def test_a_stream_whose_batch_failed_gets_the_same_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
    with caplog.at_level(logging.INFO):
        async with front_end(tmp_path, one_token_then_failure) as (client, _, _):
            streams = [await client.post("/v1/completions", json=body) for _ in range(2)]
    for stream in streams:
        assert stream.status_code == 200
        error = json_events(stream.content)[-1]["error"]
        assert (error["code"], error["message"]) == ("internal_error", "internal server error")
        assert stream.content.endswith(b"data: [DONE]\n\n")
    lines = error_lines(caplog)
    assert [(r.getMessage(), r.exc_info) for r in lines] == [
        (f"batch failed, 500 to a stream of model 'tiny' on POST '/v1/completions': {FAULT}", None)
    ]


async def test_the_line_names_envoys_request_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Which request of the proxy's it was: Envoy's `x-request-id`, on the JSON routes and
    the v2 route alike."""
    envoy = {"x-request-id": "5f0c-41a7"}
    v2 = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hello"]}]}
    with caplog.at_level(logging.INFO):
        async with front_end(tmp_path, batch_failed) as (client, _, _):
            body = {"model": "minilm", "inputs": "hello"}
            answer = await client.post("/infer", json=body, headers=envoy)
            CLOCK[0] += BATCH_FAILED_LOG_INTERVAL_S
            v2_answer = await client.post("/v2/models/minilm/infer", json=v2, headers=envoy)
    assert answer.status_code == v2_answer.status_code == 500
    assert [r.getMessage() for r in error_lines(caplog)] == [
        f"batch failed, 500 to POST '/infer' x-request-id='5f0c-41a7': {FAULT}",
        f"batch failed, 500 to POST '/v2/models/minilm/infer' x-request-id='5f0c-41a7': {FAULT}",
    ]


async def test_a_streams_line_names_envoys_request_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream's failed batch is logged as the JSON and v2 routes' are: its method, path and
    Envoy's `x-request-id` (it named the model only, and the proxy's log could not find it)."""

    envoy = {"x-request-id": "5f0c-41a7"}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
    with caplog.at_level(logging.INFO):
        async with front_end(tmp_path, one_token_then_failure) as (client, _, _):
            stream = await client.post("/v1/completions", json=body, headers=envoy)
    assert stream.status_code == 200
    assert json_events(stream.content)[-1]["error"]["code"] == "internal_error"
    assert [r.getMessage() for r in error_lines(caplog)] == [
        "batch failed, 500 to a stream of model 'tiny' on POST '/v1/completions' "
        f"x-request-id='5f0c-41a7': {FAULT}"
    ]


async def test_a_fault_of_its_own_mid_stream_names_the_request_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_frame(*args: object) -> bytes:
        raise RuntimeError("a bug")

    monkeypatch.setattr("app.api.generate.TextChunks.frame", broken_frame)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 1, "stream": True}
    with caplog.at_level(logging.INFO):
        async with front_end(tmp_path, one_token_then_failure) as (client, _, _):
            stream = await client.post(
                "/v1/completions", json=body, headers={"x-request-id": "5f0c-41a7"}
            )
    assert json_events(stream.content)[-1]["error"]["code"] == "internal_error"
    [line] = error_lines(caplog)
    assert line.exc_info is not None
    assert line.getMessage() == (
        "generation failed mid-stream on POST '/v1/completions' x-request-id='5f0c-41a7'"
    )
