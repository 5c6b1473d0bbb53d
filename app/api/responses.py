"""JSON rendering (orjson, numpy arrays included) and the error envelope of
docs/ARCHITECTURE.md §6."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

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
    payload = {"error": {"type": error_type, "message": message, "param": param}}
    return json_response(payload, status_code, headers)


def service_of(request: Request) -> Service:
    service: Service = request.app.state.service
    return service
