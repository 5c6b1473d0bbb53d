"""Every error body is OpenAI's envelope with `code` (what the openai client reads as
`APIError.code`), wherever it is built: the app's answers, the prebuilt refusals written
before a body is read, a stream's error event and the probe port's 404."""

from __future__ import annotations

import orjson
import pytest

from app.admission import RejectReason
from app.api.openai_format import error_chunk
from app.api.responses import error_response
from app.api.shedding import _shed_response
from app.probes import probe_response, readiness
from app.schemas import ErrorBody


def _checked(body: bytes | dict[str, object]) -> dict[str, object]:
    payload = orjson.loads(body) if isinstance(body, bytes) else body
    error = ErrorBody.model_validate(payload).error  # the documented schema
    assert error.code == error.type
    return payload


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
    _checked(error_chunk("internal_error", "internal server error"))
    status, body = probe_response("/nope", readiness(None, None, False, can_serve=True), None)
    assert status == 404
    _checked(body)
