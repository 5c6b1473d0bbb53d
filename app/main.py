"""`create_app(settings)`: one front end's FastAPI app, its engine connection and lifespan.

The engine is reached through an `EngineClient`:
- `settings.engine == "process"` and `engine_addresses` given: a front end of
  `steadyserve serve`, whose parent supervises the engine process;
- `"process"` without addresses: the app starts and supervises its own engine process
  (one front end; what the integration tests run);
- `"inprocess"`: the engine runs on this event loop (tests, debugging).

Lifespan: start-up loads the tokenizers and connects (the engine loads and warms up on its
own, so /healthz and /readyz answer with progress meanwhile); shutdown closes the engine
connection (and stops an owned engine). Draining on SIGTERM is driven by `cli.py` through
`Service.drain` (`drain.py`).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as instrumentator_metrics

from app import __version__
from app.api import debug, embed, generate, health, tokenize, v2
from app.api.direct import DirectRoute
from app.api.errors import install_error_handlers
from app.api.http_metrics import use_lean_instrumentator
from app.api.middleware import BodyGuardMiddleware, ServerTimingMiddleware
from app.api.openapi import install_openapi
from app.api.shedding import SheddingMiddleware
from app.api.slow import SlowRequestMiddleware
from app.api.v2_render import AnswerRenderer
from app.engine.client import EngineClient
from app.engine.protocol import EngineStatus
from app.engine.supervisor import EngineSupervisor
from app.engine.zmq_client import EngineAddresses, ZmqEngineClient
from app.generation.pipeline import TextGeneration
from app.metrics import LATENCY_BUCKETS_S, Metrics
from app.probes import ProbeListener, probe_response
from app.service import Service
from app.settings import Settings
from app.spikes.recorder import SlowRequestRecorder
from app.telemetry.sampler import ProcessTelemetry
from app.tokenizer_pool import TokenizerLoader, load_model_tokenizer

if TYPE_CHECKING:
    from app.startup import RunnerLoader  # torch: only for the type

log = logging.getLogger(__name__)

# Inference routes: the ones early shedding applies to, and slow-request reports.
INFERENCE_PATHS = frozenset({"/infer", "/v1/embeddings"})
# Generation routes are shed the same way; their time is the length the client asked for,
# so no latency threshold makes them "slow".
GENERATION_PATHS = frozenset(generate.GENERATION_ROUTES)
# Shed from headers alone, before the body is read (`app/api/shedding.py`), each by the
# waits of the models of the task it reaches (None: any model's, /infer serving both tasks).
SHED_PATHS: dict[str, str | None] = {
    "/infer": None,
    "/v1/embeddings": "embed",
    **dict.fromkeys(GENERATION_PATHS, "generate"),
}


def is_inference_path(path: str) -> bool:
    """The inference routes, the Open Inference Protocol's included: the ones slow-request
    reports time. (Those shed itself, outside the middleware: `api/v2.py`.)"""
    return path in INFERENCE_PATHS or (path.startswith("/v2/models/") and path.endswith("/infer"))


def _engine_client(
    settings: Settings,
    metrics: Metrics,
    engine_addresses: EngineAddresses | None,
    runner_loader: RunnerLoader | None,
    spawn_token: int | None = None,
) -> tuple[EngineClient, EngineSupervisor | None]:
    """The engine connection, and the supervisor when this app owns an engine process."""
    if settings.engine == "inprocess":
        # Imported here: torch and the model are loaded only where the engine runs.
        from app.engine.core import EngineCore
        from app.engine.inprocess import InProcessEngine
        from app.startup import load_runner

        loader = runner_loader if runner_loader is not None else load_runner
        return InProcessEngine(EngineCore(settings, metrics, loader)), None
    if engine_addresses is not None:
        return ZmqEngineClient(engine_addresses, spawn_token=spawn_token), None
    run_dir = Path(tempfile.mkdtemp(prefix="steadyserve-engine-"))
    addresses = EngineAddresses.in_directory(run_dir)
    supervisor = EngineSupervisor(settings, addresses, run_dir=run_dir)
    return ZmqEngineClient(addresses, on_status=_readiness_to(supervisor)), supervisor


def _readiness_to(supervisor: EngineSupervisor) -> Callable[[EngineStatus], None]:
    """Tells `supervisor` when its engine is heard ready (its restart backoff resets only
    after a minute of that)."""

    def heard(status: EngineStatus) -> None:
        if status.state == "ready":
            supervisor.saw_ready(status.pid)

    return heard


def create_app(
    settings: Settings,
    loader: RunnerLoader | None = None,
    tokenizer_loader: TokenizerLoader = load_model_tokenizer,
    engine_addresses: EngineAddresses | None = None,
    frontend_processes: int = 1,
    engine: EngineClient | None = None,
    on_started: Callable[[bool], None] | None = None,
    created: int | None = None,
    spawn_token: int | None = None,
    replacing: str | None = None,
) -> FastAPI:
    """`loader` (a `startup.RunnerLoader`) replaces model loading in an in-process engine;
    `tokenizer_loader` replaces the front end's tokenizers (tests of scheduling); `engine`
    replaces the engine connection altogether (the null engine of the front-end bench).
    `on_started(ok)` (the process tree's) is called on the event loop once the front end's
    start-up (tokenizers, engine connection) has succeeded or failed; with it the lifespan's
    start-up waits for that, and fails with it. Without it, start-up goes on in the
    background while the app answers (the in-process server's probes report it). `created`:
    the served models' `created` on /v1/models (Unix seconds): the process tree's start,
    the same in every front end; by default now (an in-process server is the whole tree).
    `spawn_token`: the one the process tree started this front end with, in its identity
    (`FrontEndGone`). `replacing`: why the front end this one replaces ended (`died`,
    `hung`), None for a first start."""
    metrics = Metrics()
    if replacing is not None:
        # Counted by the new front end, as the engine counts its own restarts: a counter
        # outlives its process in multiprocess mode, so the total is the number of restarts.
        metrics.frontend_restarts.labels(replacing).inc()
    supervisor: EngineSupervisor | None = None
    if engine is None:
        engine, supervisor = _engine_client(
            settings, metrics, engine_addresses, loader, spawn_token
        )
    service = Service(
        settings,
        metrics,
        engine,
        tokenizer_loader=tokenizer_loader,
        frontend_processes=frontend_processes,
    )

    # This front end's probes (with the engine in-process, they watch the engine's process
    # and loop too, and count the container's figures).
    telemetry = ProcessTelemetry.for_process(
        "frontend", metrics, publishes_container=settings.engine == "inprocess"
    )
    # With the engine in-process this app is the whole server: it answers the probe port
    # itself (in engine-process mode the supervisor does), /metrics there as on its traffic
    # port. The image sets the port, and its HEALTHCHECK, the Kubernetes probes and the
    # ServiceMonitor's scrapes go there whatever the mode.
    probes = (
        ProbeListener(
            settings.host,
            settings.health_port,
            lambda path: probe_response(path, service.readiness(), service.liveness()),
            lambda: health.scrape(service),
        )
        if settings.engine == "inprocess" and settings.health_port is not None
        else None
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.spike_reports:
            telemetry.start()
        if supervisor is not None:
            supervisor.start()
        if probes is not None:
            await probes.start()
        startup = asyncio.create_task(service.start(), name="startup")
        app.state.startup_task = startup
        try:
            if on_started is not None:
                # In the process tree uvicorn opens the shared port only once this returns,
                # so a front end (re)starting takes no connection before it can serve: one
                # answering /readyz 503 there got the whole replica marked unhealthy by
                # Envoy's health check, which may land on any front end. One whose start-up
                # failed exits (run_uvicorn: 1) without having listened. The supervisor's
                # probe port answers meanwhile.
                await asyncio.wait({startup})
                on_started(service.started)
                if not service.started:
                    raise RuntimeError("front-end start-up failed (logged above)")
            yield
        finally:
            if not startup.done():
                startup.cancel()
            await asyncio.gather(startup, return_exceptions=True)
            await service.stop()
            app.state.v2_renderer.close()
            if supervisor is not None:
                await supervisor.stop()
            if probes is not None:
                await probes.close()
            await telemetry.stop()

    # No trailing-slash redirects: `POST /infer/` got an empty 307 (past the shedding,
    # which matches exact paths) and the client re-posted its body; now a JSON 404.
    # FastAPI's native OpenTelemetry off: steadyserve's telemetry is its Prometheus metrics,
    # Server-Timing and slow-request reports, and the check whether a provider is set up
    # read the environment three times per request (~4 % of an admitted request's time).
    app = FastAPI(
        title="steadyserve",
        version=__version__,
        lifespan=lifespan,
        redirect_slashes=False,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.service = service
    app.state.v2_renderer = AnswerRenderer()  # large /v2 answers' render thread
    app.state.generation = TextGeneration(service)
    app.state.settings = settings
    app.state.models_created = int(time.time()) if created is None else created
    app.state.supervisor = supervisor
    app.state.telemetry = telemetry
    app.state.recorder = None
    app.state.shed_paths = SHED_PATHS
    install_error_handlers(app)
    install_openapi(app, service)
    app.include_router(embed.router)
    app.include_router(generate.router)
    app.include_router(tokenize.router)
    app.include_router(health.router)
    app.include_router(debug.router)
    app.include_router(v2.router)
    # Innermost: inside the HTTP metrics and every middleware below.
    app.add_middleware(
        DirectRoute,
        endpoints={
            "/infer": embed.infer,
            "/v1/embeddings": embed.embeddings,
            "/v1/completions": generate.completions,
            "/v1/chat/completions": generate.chat_completions,
        },
        exception_handlers=app.exception_handlers,
    )
    Instrumentator(
        registry=metrics.registry,
        excluded_handlers=["/metrics", "/healthz", "/readyz"],
    ).add(
        instrumentator_metrics.requests(registry=metrics.registry),
        instrumentator_metrics.latency(buckets=LATENCY_BUCKETS_S, registry=metrics.registry),
    ).instrument(app)
    use_lean_instrumentator(app)
    if settings.spike_reports:
        recorder = SlowRequestRecorder(
            metrics,
            settings.slow_request_ms / 1000,
            settings.slow_request_p99_multiple,
            settings.slow_request_reports,
        )
        app.state.recorder = recorder
        app.add_middleware(
            SlowRequestMiddleware,
            recorder=recorder,
            telemetry=telemetry,
            is_inference=is_inference_path,
            batching_window_s=settings.max_wait_ms / 1000,
        )
    # Added last = outermost. The body guard bounds a body's size and the time it takes to
    # arrive; Server-Timing wraps it so its answers carry the header too; shedding, outermost,
    # refuses from headers alone before anything else runs (its answers are prebuilt, with
    # their own Server-Timing).
    app.add_middleware(
        BodyGuardMiddleware,
        max_body_bytes=settings.max_body_bytes,
        read_timeout_s=settings.body_read_timeout_s,
    )
    app.add_middleware(ServerTimingMiddleware, is_draining=lambda: service.admission.draining)
    app.add_middleware(SheddingMiddleware, service=service, paths=SHED_PATHS)
    return app
