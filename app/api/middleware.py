"""Pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects).

- `BodyLimitMiddleware`: a body over `max_body_bytes` gets 413 before it is parsed, whether
  it declares its length or streams it chunked.
- `ServerTimingMiddleware`: every response carries `Server-Timing`, with the phases the
  request recorded in `request.state.server_timing` and its total (unhandled errors are
  answered here, as a JSON 500, for that reason); while the server is draining, responses
  also say `Connection: close` so clients move to another replica.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.responses import error_response
from app.timing import PhaseTimer

log = logging.getLogger(__name__)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await self._reject(scope, receive, send)
                return
        seen = 0
        exceeded = False

        async def limited_receive() -> Message:
            # Stop reading at the limit. The app sees a disconnect; whatever it answers
            # (frameworks turn a broken body into a 400) is replaced by the 413 below.
            nonlocal seen, exceeded
            if exceeded:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    exceeded = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not exceeded:
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
        if exceeded:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            "body_too_large",
            f"request body exceeds {self.max_body_bytes} bytes",
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)


class ServerTimingMiddleware:
    def __init__(self, app: ASGIApp, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self.is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        timer = PhaseTimer()
        scope.setdefault("state", {})["server_timing"] = timer
        response_started = False

        async def send_with_timing(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
                headers = list(message.get("headers", []))
                headers.append((b"server-timing", timer.header().encode("latin-1")))
                if self.is_draining():
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_timing)
        except Exception:
            # A fault of the server's own: answered here (not by Starlette's outermost error
            # middleware) so that the 500 carries Server-Timing like every other response.
            if response_started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            response = error_response(500, "internal_error", "internal server error")
            await response(scope, receive, send_with_timing)
