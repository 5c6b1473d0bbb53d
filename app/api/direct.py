"""The hot POST routes (`/infer`, `/v1/embeddings`, `/v1/completions`,
`/v1/chat/completions`) without FastAPI's per-request routing machinery.

Before an endpoint runs, FastAPI takes each request through its router (the routes matched
in turn, through the included routers), an exit stack, its body-limit and telemetry
middleware and dependency solving: ~110 us of a front end's ~360 us per admitted `/infer`
(measured with the null engine, docs/BENCHMARKS.md, "The direct /infer route"); ~150 us of
a non-streamed completion's ~930 us (the tiny causal LM, docs/BENCHMARKS.md, session 17).
`DirectRoute`, the innermost middleware (inside the HTTP metrics, so requests are counted as
before), hands a POST to one of its paths straight to the endpoint function that path's
FastAPI route runs, which reads its own body (`api/common.py::json_body`), and answers any
exception with the app's own exception handlers, as FastAPI's would. The FastAPI routes stay
registered: they document the endpoints and answer their other methods.

Front-end event loop thread only.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

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
        endpoints: Mapping[str, Endpoint],
        exception_handlers: Mapping[Any, ExceptionHandler],
    ) -> None:
        """`endpoints`: the endpoint function of each path's `POST` route, by path."""
        self.app = app
        self.endpoints = dict(endpoints)
        self.exception_handlers = exception_handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoints.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as error:
            handler = self._handler_for(error)
            if handler is None:
                raise  # a fault of the server's: answered 500 by ServerTimingMiddleware
            # The app's handlers are coroutines; a plain function's answer is used as is.
            answer = handler(request, error)
            response = await answer if inspect.isawaitable(answer) else answer
        await response(scope, receive, send)

    def _handler_for(self, error: Exception) -> ExceptionHandler | None:
        """The handler Starlette's exception middleware would pick: the first registered
        for the error's class or one of its bases."""
        for kind in type(error).__mro__:
            handler = self.exception_handlers.get(kind)
            if handler is not None:
                return handler
        return None
