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
    """Buffer-pool slots, in use, misses and bytes, per model and shape."""
    if (denied := _denied(request)) is not None:
        return denied
    service = service_of(request)
    report = {}
    for name, batcher in service.batchers.items():
        stats = batcher.pool.stats()
        report[name] = {
            "bytes_preallocated": stats.bytes_preallocated,
            "misses": stats.misses,
            "acquire_waits": stats.acquire_waits,
            "shapes": [
                {
                    "batch": shape.batch,
                    "length": shape.length,
                    "slots": total,
                    "in_use": stats.in_use[shape],
                    "estimated_compute_ms": round(
                        batcher.scheduler.estimated_compute(shape) * 1000, 3
                    ),
                }
                for shape, total in stats.slots.items()
            ],
        }
    return json_response(report)


@router.get("/config")
async def config(request: Request) -> Response:
    """The settings in effect (the debug token itself withheld)."""
    if (denied := _denied(request)) is not None:
        return denied
    service = service_of(request)
    settings = service.settings.model_dump(mode="json")
    settings["debug_token"] = "***"
    return json_response(
        {
            "settings": settings,
            "device": str(service.device),
            "threads": {
                "compute": service.dispatcher.plan.compute_threads,
                "tokenizer": service.dispatcher.plan.tokenizer_threads,
                "torch_intra_op": service.dispatcher.plan.torch_intra_op,
                "torch_inter_op": service.dispatcher.plan.torch_inter_op,
            },
        }
    )
