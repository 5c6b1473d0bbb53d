"""GET /debug/pool, /debug/config and /debug/slow: off unless STEADY_DEBUG_TOKEN is set,
and then only for requests that present it as a bearer token (constant-time compare)."""

from __future__ import annotations

import hmac
import os

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.api.responses import error_response, json_response, service_of

router = APIRouter(prefix="/debug", include_in_schema=False)


def _denied(request: Request) -> Response | None:
    service = service_of(request)
    token = service.settings.debug_token
    if token is None:
        return error_response(404, "not_found", "debug endpoints are disabled")
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    # Settings refuse an empty token; checked again here because an empty one would match
    # a request that presents nothing.
    valid = scheme.lower() == "bearer" and bool(token)
    if not (hmac.compare_digest(presented.encode(), token.encode()) and valid):
        return error_response(
            401, "unauthorized", "bad or missing bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )  # fmt: skip
    return None


@router.get("/pool")
async def pool(request: Request) -> Response:
    """Buffer-pool slots, in use, misses and bytes, per model and shape (from the engine)."""
    if (denied := _denied(request)) is not None:
        return denied
    return json_response(await service_of(request).engine.debug("pool"))


@router.get("/config")
async def config(request: Request) -> Response:
    """The settings in effect (the debug token itself withheld), and the engine's device
    and threads."""
    if (denied := _denied(request)) is not None:
        return denied
    service = service_of(request)
    settings = service.settings.model_dump(mode="json")
    settings["debug_token"] = "***"
    return json_response({"settings": settings, **await service.engine.debug("config")})


@router.get("/slow")
async def slow(request: Request, limit: int = 50) -> Response:
    """This front end's recent slow-request reports, newest first, with their causes
    (docs/SPIKES.md). With several front ends, each answers with its own reports: the
    `frontend_pid` says whose."""
    if (denied := _denied(request)) is not None:
        return denied
    recorder = getattr(request.app.state, "recorder", None)
    if recorder is None:
        return error_response(404, "not_found", "slow-request reports are off")
    if limit < 1:
        return error_response(400, "invalid_request", "limit must be at least 1", "limit")
    return json_response(
        {
            "frontend_pid": os.getpid(),
            "threshold_ms": round(recorder.threshold_s() * 1000, 2),
            "reports": [report.as_dict() for report in recorder.recent(limit)],
        }
    )
