"""`LeanInstrumentator` records exactly what prometheus-fastapi-instrumentator's own
middleware records (same series, same counts), and its route cache stays bounded."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as instrumentator_metrics
from starlette.responses import JSONResponse

from app.api.http_metrics import LeanInstrumentator, use_lean_instrumentator

REQUESTS = [
    ("GET", "/static"),
    ("GET", "/static"),
    ("POST", "/static"),  # method not allowed: 405, still the route's handler
    ("GET", "/items/1"),
    ("GET", "/items/2"),
    ("GET", "/nowhere/1"),  # unknown: grouped as "none"
    ("GET", "/nowhere/2"),
    ("GET", "/healthz"),  # excluded
    ("GET", "/fails"),
]


def _app(lean: bool) -> tuple[FastAPI, CollectorRegistry]:
    registry = CollectorRegistry()
    app = FastAPI()

    @app.get("/static")
    async def static() -> JSONResponse:
        return JSONResponse({"ok": True})

    @app.get("/items/{item}")
    async def item(item: int) -> JSONResponse:
        return JSONResponse({"item": item})

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({})

    @app.get("/fails")
    async def fails() -> JSONResponse:
        return JSONResponse({"error": "x"}, status_code=429)

    Instrumentator(registry=registry, excluded_handlers=["/healthz"]).add(
        instrumentator_metrics.requests(registry=registry),
        instrumentator_metrics.latency(registry=registry),
    ).instrument(app)
    if lean:
        use_lean_instrumentator(app)
    return app, registry


def _series(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample but the latency sums (timings differ between runs)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_sum")
        and not sample.name.endswith("_created")
        and not (sample.name.endswith("_bucket") and sample.labels.get("le") != "+Inf")
    }


def _drive(app: FastAPI) -> None:
    with TestClient(app) as client:
        for method, path in REQUESTS:
            client.request(method, path)


def test_records_the_same_series_as_the_librarys_middleware() -> None:
    library_app, library_registry = _app(lean=False)
    lean_app, lean_registry = _app(lean=True)
    _drive(library_app)
    _drive(lean_app)
    expected = _series(library_registry)
    assert any(labels and dict(labels).get("handler") == "/items/{item}" for _, labels in expected)
    assert any(labels and dict(labels).get("handler") == "none" for _, labels in expected)
    assert _series(lean_registry) == expected


def test_only_parameterless_routes_are_remembered() -> None:
    app, _ = _app(lean=True)
    _drive(app)
    middleware = app.middleware_stack
    while not isinstance(middleware, LeanInstrumentator):
        middleware = middleware.app  # type: ignore[union-attr]
    assert set(middleware._static_handlers) == {"/static", "/healthz", "/fails"}


def test_a_method_the_app_does_not_serve_is_counted_as_other() -> None:
    """A client's method names no series of its own (a scanner's PROPFIND, MKCOL, ...): a
    method no route serves is OTHER (HEAD too: FastAPI's GET routes answer it 405)."""
    app, registry = _app(lean=True)
    with TestClient(app) as client:
        for method in ("PROPFIND", "MKCOL", "GET", "HEAD"):
            client.request(method, "/static")
    methods = {
        sample.labels["method"]
        for family in registry.collect()
        for sample in family.samples
        if "method" in sample.labels
    }
    assert methods == {"OTHER", "GET"}
    assert (
        registry.get_sample_value(
            "http_requests_total", {"handler": "/static", "method": "OTHER", "status": "4xx"}
        )
        == 3
    )
