"""POST /infer without FastAPI's per-request routing machinery.

Before an endpoint runs, FastAPI takes each request through its router (the routes matched
in turn, through the included routers), an exit stack, its body-limit and telemetry
middleware and dependency solving: ~110 us of a front end's ~360 us per admitted `/infer`
(measured with the null engine, docs/BENCHMARKS.md, "The direct /infer route").
`DirectRoute`, the innermost middleware (inside the HTTP metrics, so requests are counted as
before), hands a POST to its path straight to the endpoint function the FastAPI route runs,
which reads its own body (`api/common.py::json_body`), and answers any exception with the
app's own exception handlers, as FastAPI's would. The FastAPI route stays registered: it
documents the endpoint and answers its other methods.

Front-end event loop thread only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette._utils import is_async_callable
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]
# As Starlette registers them: by exception class (or status code), sync or async.
ExceptionHandler = Callable[[Request, Any], Response | Awaitable[Response]]


class DirectRoute:
    def __init__(
        self,
        app: ASGIApp,
        path: str,
        endpoint: Endpoint,
        exception_handlers: Mapping[Any, ExceptionHandler],
    ) -> None:
        self.app = app
        self.path = path
        self.endpoint = endpoint
        self.exception_handlers = exception_handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await self.endpoint(request)
        except Exception as error:
            handler = self._handler_for(error)
            if handler is None:
                raise  # a fault of the server's: answered 500 by ServerTimingMiddleware
            if is_async_callable(handler):
                response = await handler(request, error)
            else:
                response = await run_in_threadpool(handler, request, error)  # type: ignore[arg-type]
        await response(scope, receive, send)

    def _handler_for(self, error: Exception) -> ExceptionHandler | None:
        """The handler Starlette's exception middleware would pick: the first registered
        for the error's class or one of its bases."""
        for kind in type(error).__mro__:
            handler = self.exception_handlers.get(kind)
            if handler is not None:
                return handler
        return None
