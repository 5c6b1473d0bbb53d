"""Liveness, readiness and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import PlainTextResponse, Response

from app.api.responses import json_response, service_of

router = APIRouter()


@router.get("/healthz")
async def healthz(request: Request) -> Response:
    """200 while the process can serve; 503 once start-up failed (so it gets restarted)."""
    service = service_of(request)
    if not service.alive:
        return json_response({"status": "failed", "error": service.readiness().error}, 503)
    return json_response({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """200 when every warm-up shape ran and the server is not draining; 503 otherwise,
    saying why."""
    state = service_of(request).readiness()
    body: dict[str, object] = {
        "status": state.status,
        "warmup": {"done": state.warmup_done, "total": state.warmup_total},
    }
    if state.error:
        body["error"] = state.error
    return json_response(body, 200 if state.ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    service = service_of(request)
    service.refresh_gauges()
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
