"""Pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects).

- `SheddingMiddleware`: an inference request the server cannot take (draining, no ready
  engine, the engine's backlog over the delay budget, an empty token bucket) is refused
  from its method, path and headers alone, before its body is read, with a prebuilt
  429/503 and `Retry-After`: microseconds per refusal, whatever the flood.
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
import time
from collections.abc import Callable, Collection
from functools import lru_cache

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.admission import Rejected, RejectReason
from app.api.errors import REJECTION_STATUS
from app.api.responses import error_response
from app.service import Service
from app.timing import PhaseTimer

log = logging.getLogger(__name__)

_ENVOY_TIMEOUT_HEADER = b"x-envoy-expected-rq-timeout-ms"

# Why a request was shed, as its body says (the exact figures are in the metrics; a
# prebuilt answer cannot carry them).
_SHED_MESSAGES = {
    "queue": "over capacity: the predicted queue delay exceeds the budget; retry after "
    "Retry-After seconds",
    "rate": "over the admission rate; retry after Retry-After seconds",
    "deadline": "the deadline is too short for the current queue",
    "draining": "server is draining; retry on another replica",
    "not_ready": "the engine is not ready",
}


@lru_cache(maxsize=64)
def _shed_response(
    reason: str, retry_after: str | None, close: bool
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers and body of a refusal, built once per distinct answer."""
    status = REJECTION_STATUS[RejectReason(reason)]
    body = orjson.dumps(
        {"error": {"type": reason, "message": _SHED_MESSAGES.get(reason, reason), "param": None}}
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", retry_after.encode()))
    if close:
        headers.append((b"connection", b"close"))
    return status, headers, body


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


class SheddingMiddleware:
    def __init__(self, app: ASGIApp, service: Service, paths: Collection[str]) -> None:
        self.app = app
        self.service = service
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        rejection = self.service.shed(_envoy_timeout_ms(scope))
        if rejection is None:
            try:
                await self.app(scope, receive, send)
            finally:
                self.service.leave()
            return
        await send_rejection(rejection, send, started, close=self.service.admission.draining)


async def send_rejection(rejection: Rejected, send: Send, started: float, close: bool) -> None:
    """Answer a refusal with its prebuilt response (the body is never read)."""
    status, headers, body = _shed_response(
        rejection.reason.value, rejection.retry_after_header, close
    )
    timing = f"shed;dur={(time.perf_counter() - started) * 1000:.3f}".encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"server-timing", timing)],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _envoy_timeout_ms(scope: Scope) -> float | None:
    value = _header(scope, _ENVOY_TIMEOUT_HEADER)
    try:
        return float(value) if value is not None else None
    except ValueError:
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
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._reject(scope, receive, send, 413)
            return
        seen = 0
        refused: int | None = None  # the status replacing the app's answer, if any
        body_done = False
        give_up_at = asyncio.get_running_loop().time() + self.read_timeout_s

        async def guarded_receive() -> Message:
            # Stop reading at the limit or the timeout. The app sees a disconnect; whatever
            # it answers (frameworks turn a broken body into a 400) is replaced below.
            nonlocal seen, refused, body_done
            if refused is not None:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()  # after the body: only a disconnect can come
            remaining = give_up_at - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, remaining))
            except TimeoutError:
                refused = 408
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max_body_bytes:
                    refused = 413
                    return {"type": "http.disconnect"}
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

    async def _reject(self, scope: Scope, receive: Receive, send: Send, status: int) -> None:
        if status == 413:
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
