"""Pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects).

- `BodyGuardMiddleware`: a body over `max_body_bytes` gets 413 before it is parsed, whether
  it declares its length or streams it chunked; a body that does not arrive in full within
  `read_timeout_s` (a stalled or trickling client) gets 408 and its connection is closed.
- `ServerTimingMiddleware`: every response carries `Server-Timing`, with the phases the
  request recorded in `request.state.server_timing` and its total (unhandled errors are
  answered here, as a JSON 500, for that reason); while the server is draining, responses
  also say `Connection: close` so clients move to another replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import described
from app.api.responses import error_response, in_envelope_of
from app.timing import PhaseTimer

log = logging.getLogger(__name__)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


class BodyGuardMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, read_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        encoding = (_header(scope, b"content-encoding") or b"").strip().lower().decode("latin-1")
        if encoding not in ("", "identity"):
            await self._reject(scope, receive, send, 415, encoding)
            return
        declared = _header(scope, b"content-length")
        if (
            declared is not None
            and declared.isascii()
            and declared.isdigit()
            # A value of thousands of digits (leading zeros pass the HTTP parser) is over
            # any limit, and `int` refuses to read it (ValueError: a 500).
            and (
                len(digits := declared.lstrip(b"0")) > 18
                or int(digits or b"0") > self.max_body_bytes
            )
        ):
            await self._reject(scope, receive, send, 413)
            return
        seen = 0
        refused: int | None = None  # the status replacing the app's answer, if any
        body_done = False
        give_up_at = asyncio.get_running_loop().time() + self.read_timeout_s

        def refuse(status: int) -> Message:
            nonlocal refused
            refused = status
            timer: PhaseTimer | None = scope.get("state", {}).get("server_timing")
            if timer is not None:
                timer.latency_bound = False  # the client's slowness or size, not a slow request
            return {"type": "http.disconnect"}

        async def guarded_receive() -> Message:
            # Stop reading at the limit or the timeout. The app sees a disconnect; whatever
            # it answers (frameworks turn a broken body into a 400) is replaced below.
            nonlocal seen, body_done
            if refused is not None:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()  # after the body: only a disconnect can come
            try:
                # A timeout in this task, not `wait_for`, which on Python 3.11 runs each
                # receive in a task of its own.
                async with asyncio.timeout_at(give_up_at):
                    message = await receive()
            except TimeoutError:
                return refuse(408)
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max_body_bytes:
                    return refuse(413)
            return message

        async def guarded_send(message: Message) -> None:
            if refused is None:
                await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if refused is None:
                raise
        if refused is not None:
            await self._reject(scope, receive, send, refused)

    async def _reject(
        self, scope: Scope, receive: Receive, send: Send, status: int, encoding: str = ""
    ) -> None:
        if status == 415:
            # Before any byte is read: the connection stays usable.
            response = error_response(
                415,
                "unsupported_content_encoding",
                f"Content-Encoding {encoding!r} is not accepted: send the body uncompressed",
            )
        elif status == 413:
            response = error_response(
                413,
                "body_too_large",
                f"request body exceeds {self.max_body_bytes} bytes",
                headers={"Connection": "close"},
            )
        else:
            response = error_response(
                408,
                "body_timeout",
                f"request body not received within {self.read_timeout_s:g} s",
                headers={"Connection": "close"},
            )
        await in_envelope_of(scope.get("path", ""), response)(scope, receive, send)


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
            log.exception("unhandled error on %s", described(scope))  # the path as repr shows it
            response = error_response(500, "internal_error", "internal server error")
            await in_envelope_of(scope.get("path", ""), response)(scope, receive, send_with_timing)
