"""`create_app(settings)`: the FastAPI app and its lifespan.

Lifespan: start-up launches loading and warm-up in the background (so /healthz and /readyz
answer, with progress, while it runs); shutdown stops the batchers after they empty and
then the dispatcher. Draining on SIGTERM is driven by `cli.py` through `Service.begin_drain`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_fastapi_instrumentator import Instrumentator

from app import __version__
from app.api import debug, embed, health
from app.api.errors import install_error_handlers
from app.api.middleware import BodyLimitMiddleware, ServerTimingMiddleware
from app.api.openapi import install_openapi
from app.metrics import LATENCY_BUCKETS_S, Metrics
from app.service import Service
from app.settings import Settings
from app.startup import RunnerLoader, load_runner

log = logging.getLogger(__name__)


def create_app(settings: Settings, loader: RunnerLoader = load_runner) -> FastAPI:
    metrics = Metrics()
    service = Service(settings, metrics, loader=loader)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        startup = asyncio.create_task(service.start(), name="startup")
        app.state.startup_task = startup
        try:
            yield
        finally:
            if not startup.done():
                startup.cancel()
            await asyncio.gather(startup, return_exceptions=True)
            await service.stop()

    app = FastAPI(title="steadyserve", version=__version__, lifespan=lifespan)
    app.state.service = service
    app.state.settings = settings
    install_error_handlers(app)
    install_openapi(app, service)
    app.include_router(embed.router)
    app.include_router(health.router)
    app.include_router(debug.router)
    Instrumentator(
        registry=metrics.registry,
        excluded_handlers=["/metrics", "/healthz", "/readyz"],
    ).instrument(app, latency_highr_buckets=LATENCY_BUCKETS_S)
    # Added last = outermost. The body limit applies before anything reads the body;
    # Server-Timing wraps it so that its 413s carry the header too.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(ServerTimingMiddleware, is_draining=lambda: service.admission.draining)
    return app
