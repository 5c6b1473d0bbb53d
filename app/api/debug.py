"""GET /debug/pool and /debug/config: off unless STEADY_DEBUG_TOKEN is set, and then only
for requests that present it as a bearer token (constant-time compare)."""

from __future__ import annotations

import hmac

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
