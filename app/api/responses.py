"""JSON rendering (orjson, numpy arrays included) and the error envelopes: the project's
(docs/ARCHITECTURE.md §6), with OpenAI's error types under /v1, and, under /v2, the Open
Inference Protocol's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from app.schemas import error_object, openai_error_type
from app.service import Service


def json_response(
    content: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code, headers=headers, media_type="application/json")


def error_response(
    status_code: int,
    error_type: str,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    return json_response(error_object(error_type, message, param), status_code, headers)


def v2_error(message: str, status: int, headers: Mapping[str, str] | None = None) -> Response:
    """An error in the Open Inference Protocol's envelope: `{"error": message}`."""
    body = orjson.dumps({"error": message})
    return Response(body, status, headers=headers, media_type="application/json")


def speaks_open_inference(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def speaks_openai(path: str) -> bool:
    """The OpenAI-compatible routes (/v1/embeddings, /v1/completions, ...)."""
    return path == "/v1" or path.startswith("/v1/")


def in_envelope_of(path: str, response: Response) -> Response:
    """An `error_response` in the envelope of the protocol `path` belongs to: a KServe or
    Triton client reads `error` as a string, and got the project's object from every error
    answered outside the v2 routes (an unknown route, a wrong method, a body too large or
    too slow, a server fault); under /v1 the object's `type` is OpenAI's for the status
    (`schemas.openai_error_object`), its reason staying in `code`. Any other response, or
    path, is returned as is."""
    v2 = speaks_open_inference(path)
    if not v2 and not speaks_openai(path):
        return response
    try:
        error = orjson.loads(response.body)["error"]
        message = error["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return response  # not an error envelope (a 499 the client never reads)
    headers = {
        name: value
        for name, value in response.headers.items()
        if name not in ("content-length", "content-type")
    }
    if v2:
        return v2_error(message, response.status_code, headers)
    error["type"] = openai_error_type(response.status_code)
    return json_response({"error": error}, response.status_code, headers)


def service_of(request: Request) -> Service:
    service: Service = request.app.state.service
    return service
