"""Liveness, readiness and metrics.

Both probes answer from state the front end already holds (the engine's last published
status), never by asking the engine, so they stay fast whatever the engine is doing.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response

from app.api.errors_doc import CONNECTION_CAP
from app.api.responses import service_of
from app.probes import HEALTHZ, METRICS, READYZ, probe_response
from app.service import Service

router = APIRouter()

_JSON = {"application/json": {"schema": {"type": "object"}}}
_HEALTHZ_ANSWERS: dict[int | str, dict[str, object]] = {
    200: {"description": 'Leave it running: {"status": "ok"}', "content": _JSON},
    503: {"description": 'Restart it: {"status": "unhealthy", "problem"}', "content": _JSON},
    **CONNECTION_CAP,
}
_READYZ_ANSWERS: dict[int | str, dict[str, object]] = {
    200: {"description": "Ready: every shape warmed up, not draining", "content": _JSON},
    503: {"description": "Not ready (warming up, draining, no engine): why", "content": _JSON},
    **CONNECTION_CAP,
}


@router.get(HEALTHZ, responses=_HEALTHZ_ANSWERS)
async def healthz(request: Request) -> Response:
    """200 while the server should be left running; 503 once start-up failed or the
    engine's batches keep failing (so it gets restarted). An engine that is restarting is
    not a reason to restart the pod: readiness covers it."""
    service = service_of(request)
    return _probe(HEALTHZ, service)


@router.get(READYZ, responses=_READYZ_ANSWERS)
async def readyz(request: Request) -> Response:
    """200 when the engine has warmed up every shape and the server is not draining; 503
    otherwise, saying why."""
    return _probe(READYZ, service_of(request))


def _probe(path: str, service: Service) -> Response:
    status, body = probe_response(path, service.readiness(), service.liveness())
    return Response(body, status, media_type="application/json")


@router.get(METRICS, response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    return Response(await scrape(service_of(request)), media_type=CONTENT_TYPE_LATEST)


async def scrape(service: Service) -> bytes:
    """The Prometheus text of /metrics: this route's, and the in-process server's on its
    probe port (`ProbeListener`). Event loop thread."""
    service.engine.refresh_metrics()
    # Off the event loop: the merge reads every process's files, and waits (flock) while
    # the supervisor folds a dead process's into the archive (app/metrics_archive.py).
    return await asyncio.to_thread(service.metrics.render)
