"""What every inference route shares: Envoy's deadline header, the input-count limit, and
rendering an answer as JSON (timed as the `serialise` phase)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from starlette.responses import Response

from app.api.responses import error_response, json_response
from app.service import Service
from app.timing import PhaseTimer

ENVOY_TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"


def envoy_timeout_ms(request: Request) -> float | None:
    value = request.headers.get(ENVOY_TIMEOUT_HEADER)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def too_many_inputs(service: Service, count: int, param: str) -> Response | None:
    limit = service.settings.max_inputs_per_request
    if count <= limit:
        return None
    return error_response(
        413, "too_many_inputs", f"{count} inputs; at most {limit} per request", param
    )


def render(request: Request, content: Any) -> Response:
    """The JSON answer, its rendering timed as the `serialise` phase."""
    started = time.perf_counter()
    response = json_response(content)
    timer: PhaseTimer = request.state.server_timing
    timer.add("serialise", time.perf_counter() - started)
    return response
