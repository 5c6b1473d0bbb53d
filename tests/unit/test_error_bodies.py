"""Every error body is OpenAI's envelope with `code` (what the openai client reads as
`APIError.code`), wherever it is built: the app's answers, the prebuilt refusals written
before a body is read, a stream's error event and the probe port's 404. On the OpenAI
routes `type` is OpenAI's class of the error, for every error the app answers."""

from __future__ import annotations

import orjson
import pytest

from app.admission import RejectReason
from app.api.openai_format import error_chunk
from app.api.responses import error_response, in_envelope_of
from app.api.shedding import _shed_response
from app.probes import probe_response, readiness
from app.schemas import ErrorBody
from tests.support.answered_errors import answered_error_types

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


def _checked(body: bytes | dict[str, object], openai: bool = False) -> dict[str, object]:
    payload = orjson.loads(body) if isinstance(body, bytes) else body
    error = ErrorBody.model_validate(payload).error  # the documented schema
    if not openai:
        assert error.code == error.type
    return payload


def openai_type_of(status: int) -> str:
    """OpenAI's API and SDK: a 429 is over a limit, a 5xx the server's, any other 4xx the
    request's."""
    if status == 429:
        return "rate_limit_exceeded"
    return "server_error" if status >= 500 else "invalid_request_error"


def test_an_answered_error_carries_its_code() -> None:
    response = error_response(400, "context_length_exceeded", "too long", "prompt")
    assert _checked(bytes(response.body))["error"] == {
        "type": "context_length_exceeded",
        "message": "too long",
        "param": "prompt",
        "code": "context_length_exceeded",
    }


@pytest.mark.parametrize("reason", [reason.value for reason in RejectReason])
def test_a_refusal_written_before_the_body_carries_its_code(reason: str) -> None:
    _status, _headers, body = _shed_response(reason, "1", False)
    assert _checked(body)["error"]["code"] == reason  # type: ignore[index]


def test_a_streams_error_event_and_the_probe_ports_404_carry_their_code() -> None:
    event = _checked(error_chunk(500, "internal_error", "internal server error"), openai=True)
    assert event["error"]["type"] == "server_error"  # type: ignore[index]
    assert event["error"]["code"] == "internal_error"  # type: ignore[index]
    status, body = probe_response("/nope", readiness(None, None, False, can_serve=True), None)
    assert status == 404
    _checked(body)


@pytest.mark.parametrize("path", OPENAI_PATHS)
def test_the_openai_routes_answer_every_error_in_openai_s_vocabulary(path: str) -> None:
    """Every (status, reason) the app answers (found by reading its code): `type` is OpenAI's
    for the status, `code` the reason clients key on; `param` and the message unchanged."""
    answered = answered_error_types()
    assert {openai_type_of(status) for status, _ in answered} == {
        "invalid_request_error",
        "rate_limit_exceeded",
        "server_error",
    }
    for status, reason in sorted(answered):
        response = error_response(status, reason, "why", "prompt", {"Retry-After": "1"})
        answer = in_envelope_of(path, response)
        assert answer.status_code == status and answer.headers["retry-after"] == "1"
        assert _checked(bytes(answer.body), openai=True)["error"] == {
            "type": openai_type_of(status),
            "message": "why",
            "param": "prompt",
            "code": reason,
        }, (status, reason)


@pytest.mark.parametrize("path", ["/infer", "/healthz", "/debug/pool", "/v10/x"])
def test_other_routes_keep_the_reason_as_the_type(path: str) -> None:
    for status, reason in sorted(answered_error_types()):
        body = bytes(in_envelope_of(path, error_response(status, reason, "why")).body)
        assert _checked(body)["error"]["type"] == reason  # type: ignore[index]
