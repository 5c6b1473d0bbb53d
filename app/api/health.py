"""Liveness, readiness and metrics.

Both probes answer from state the front end already holds (the engine's last published
status), never by asking the engine, so they stay fast whatever the engine is doing.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response

from app.api.responses import json_response, service_of

router = APIRouter()


@router.get("/healthz")
async def healthz(request: Request) -> Response:
    """200 while the server should be left running; 503 once start-up failed or the
    engine's batches keep failing (so it gets restarted). An engine that is restarting is
    not a reason to restart the pod: readiness covers it."""
    problem = service_of(request).liveness()
    if problem is not None:
        return json_response({"status": "unhealthy", "problem": problem}, 503)
    return json_response({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """200 when the engine has warmed up every shape and the server is not draining; 503
    otherwise, saying why."""
    state = service_of(request).readiness()
    body: dict[str, object] = {
        "status": state.status,
        "warmup": {"done": state.warmup_done, "total": state.warmup_total},
    }
    if state.problem:
        body["problem"] = state.problem
    if state.engine_pid is not None:
        body["engine"] = {"pid": state.engine_pid}
    return json_response(body, 200 if state.ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    service = service_of(request)
    service.engine.refresh_metrics()
    return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)
