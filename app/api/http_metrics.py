"""prometheus-fastapi-instrumentator's HTTP metrics, recorded at a fraction of the cost.

The instrumentator defines the metrics (`http_requests_total`,
`http_request_duration_seconds`) and its middleware records them; but per request that
middleware matches the path against every route, builds a Starlette `Response` copy of the
answer's headers and awaits an empty `asyncio.gather`: ~50 us of a front end's ~300 us per
admitted request (measured with the null engine, docs/BENCHMARKS.md). `LeanInstrumentator`
is the same middleware with the same configuration and the same instrumentation functions,
minus that work: static routes are resolved once and remembered (templated and unknown paths
are matched each time, so the cache is bounded by the app's routes), and instrumentations
get no `response` copy (the library's own ones accept `None`).

The `method` label is one of the methods the app's routes serve (GET and POST: FastAPI's
GET routes answer HEAD 405), any other `OTHER`: the client's own word made a series of each
of httptools' ~35 methods for every route and status class (~28 each for the latency
histogram), kept forever in multiprocess mode's archive of dead processes' values
(`app/metrics_archive.py`): a scanner's pass added ~20,000 per front end.

Front end event loop thread only.
"""

from __future__ import annotations

import asyncio
from timeit import default_timer
from typing import Any

from prometheus_fastapi_instrumentator.metrics import Info
from prometheus_fastapi_instrumentator.middleware import PrometheusInstrumentatorMiddleware
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SERVED_METHODS = frozenset({"GET", "POST"})
OTHER_METHOD = "OTHER"


def method_label(method: str) -> str:
    """The `method` label of a request's metrics: its method where the app serves it."""
    return method if method in SERVED_METHODS else OTHER_METHOD


class LeanInstrumentator(PrometheusInstrumentatorMiddleware):
    """Drop-in for `PrometheusInstrumentatorMiddleware` (built with the same arguments)."""

    def __init__(self, app: ASGIApp, **options: Any) -> None:
        super().__init__(app, **options)
        self._static_handlers: dict[str, tuple[str, bool]] = {}

    def _handler(self, scope: Scope) -> tuple[str, bool]:
        """(handler label, whether it is a route template), as the library computes it."""
        cache = self._static_handlers
        path: str = scope["path"]
        known = cache.get(path)
        if known is not None:
            return known
        handler: str
        is_templated: bool
        handler, is_templated = self._get_handler(Request(scope))
        # Only a route without parameters names itself: remember those and only those.
        if is_templated and handler == path and "{" not in handler:
            cache[path] = (handler, is_templated)
        return handler, is_templated

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = default_timer()
        handler, is_templated = self._handler(scope)
        if self._is_handler_excluded(handler, is_templated):
            await self.app(scope, receive, send)
            return
        if not is_templated and self.should_group_untemplated:
            handler = "none"
        status_code: int = 500
        response_started: float | None = None

        async def send_wrapper(message: Message) -> None:
            nonlocal status_code, response_started
            if message["type"] == "http.response.start":
                status_code = message["status"]
                response_started = default_timer()
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            info = self._info(scope, handler, status_code, started, response_started)
            for instrumentation in self.instrumentations:
                instrumentation(info)
            if self.async_instrumentations:  # none configured here: no gather otherwise
                await asyncio.gather(*(i(info) for i in self.async_instrumentations))

    def _info(
        self,
        scope: Scope,
        handler: str,
        status_code: int,
        started: float,
        response_started: float | None,
    ) -> Info:
        finished = default_timer()
        status = str(int(status_code))  # an HTTPStatus member too
        if self.should_group_status_codes:
            status = status[0] + "xx"
        duration = max(finished - started, 0.0)
        first_byte = max(response_started - started, 0.0) if response_started else 0.0
        if self.should_round_latency_decimals:
            duration = round(duration, self.round_latency_decimals)
            first_byte = round(first_byte, self.round_latency_decimals)
        return Info(
            request=Request(scope),
            response=None,
            method=method_label(scope["method"]),
            modified_handler=handler,
            modified_status=status,
            modified_duration=duration,
            modified_duration_without_streaming=first_byte,
        )


def use_lean_instrumentator(app: Starlette) -> None:
    """Swap the middleware `Instrumentator.instrument(app)` added for `LeanInstrumentator`,
    keeping its arguments. Call before the app starts (the middleware stack is built then)."""
    for middleware in app.user_middleware:
        factory: object = middleware.cls
        if factory is PrometheusInstrumentatorMiddleware:
            middleware.cls = LeanInstrumentator  # type: ignore[assignment]  # same arguments
            return
    raise RuntimeError("the instrumentator's middleware is not installed")
