"""Refusing inference requests from their method, path and headers alone, before the body.

A request the server cannot take (draining, no ready engine, a predicted wait over the delay
budget or the request's deadline, an empty token bucket, the in-flight cap: the verdict is
`Service.shed`) gets a prebuilt 429/503 with `Retry-After` and its own Server-Timing. The
verdict is answered in one of two places:

- `shedding_protocol(...)` (`api/shedding_protocol.py`): uvicorn's httptools protocol, which
  `steadyserve serve` runs; it writes the refusal (`raw_refusal`, built here) to the socket
  as soon as the request's headers are parsed.
- `SheddingMiddleware` (here; the outermost ASGI middleware): the same refusal under any
  ASGI server (tests through httpx, a server run without the protocol, a pipelined request,
  which the protocol leaves to it so that answers keep their order), and the owner of
  every admitted request's `Service.leave`, wherever it was admitted.

Everything here runs on the event loop's thread.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import lru_cache
from http import HTTPStatus

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from app.admission import Entry, Rejected, RejectReason
from app.api.common import ENTRY, envoy_timeout_in, expects_continue
from app.api.errors import REJECTION_STATUS, refusal_headers
from app.api.responses import speaks_open_inference, speaks_openai
from app.schemas import error_object, openai_error_object
from app.service import Service

# The protocol puts a request's `Entry` in its scope (under `ENTRY`) when it lets it in: the
# middleware must not count it in again, only let it leave; its body is counted in flight by
# the route once read (`common.count_body_in`).

# Why a request was shed, as its body says (the exact figures are in the metrics; a
# prebuilt answer cannot carry them).
_SHED_MESSAGES = {
    "queue": "over capacity: the predicted queue delay exceeds the budget; retry after "
    "Retry-After seconds",
    "rate": "over the admission rate; retry after Retry-After seconds",
    "deadline": "the deadline is too short for the current queue",
    "inflight": "over capacity: too many requests in flight; retry after Retry-After seconds",
    "draining": "server is draining; retry on another replica",
    "not_ready": "the engine is not ready",
    "connections": "over capacity: too many open connections; this one is closed, retry "
    "after Retry-After seconds",
}

# Connections free as their clients close them: there is no rate to predict a wait from, so
# the next second (what Envoy answers for its own overflow: deploy/envoy/envoy.yaml).
CONNECTION_CAP_RETRY_AFTER_S = 1.0
CONNECTION_CAP_REFUSAL = Rejected(
    RejectReason.CONNECTIONS, _SHED_MESSAGES["connections"], CONNECTION_CAP_RETRY_AFTER_S
)


def envelope_of(path: str) -> str:
    """The error envelope of the protocol `path` belongs to, as the app answers its errors
    (`responses.in_envelope_of`): "v2" (`{"error": message}`), "openai" (OpenAI's `type`,
    the reason in `code`) or "steadyserve" (the reason as `type` too)."""
    if speaks_open_inference(path):
        return "v2"
    return "openai" if speaks_openai(path) else "steadyserve"


def error_body(envelope: str, status: int, reason: str, message: str) -> bytes:
    """The JSON error body of a refusal written before the app (`envelope_of`'s envelope)."""
    if envelope == "v2":
        error: object = {"error": message}
    elif envelope == "openai":
        error = openai_error_object(status, reason, message)
    else:
        error = error_object(reason, message)
    return orjson.dumps(error)


@lru_cache(maxsize=128)
def _shed_response(
    reason: str, retry_after: str | None, close: bool, envelope: str = "steadyserve"
) -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
    """Status, headers and body of a refusal in `envelope` (`envelope_of`), built once per
    distinct answer."""
    status = REJECTION_STATUS[RejectReason(reason)]
    body = error_body(envelope, status, reason, _SHED_MESSAGES.get(reason, reason))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers.extend(
        (name.lower().encode(), value.encode())
        for name, value in refusal_headers(RejectReason(reason), retry_after).items()
    )
    if close:
        headers.append((b"connection", b"close"))
    return status, tuple(headers), body


@lru_cache(maxsize=64)
def raw_refusal(
    reason: str, retry_after: str | None, close: bool, envelope: str
) -> tuple[bytes, bytes]:
    """The same refusal as HTTP/1.1 bytes: status line with its fixed headers, and body."""
    status, headers, body = _shed_response(reason, retry_after, close, envelope)
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()]
    lines.extend(name + b": " + value + b"\r\n" for name, value in headers)
    return b"".join(lines), body


def shed_timing(started: float) -> bytes:
    return f"shed;dur={(time.perf_counter() - started) * 1000:.3f}".encode()


class SheddingMiddleware:
    def __init__(self, app: ASGIApp, service: Service, paths: Mapping[str, str | None]) -> None:
        """`paths`: those shed, each with the task of the models it reaches (None: any)."""
        self.app = app
        self.service = service
        self.paths = dict(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        entry: Entry | None = scope.get(ENTRY)
        if entry is None:
            started = time.perf_counter()
            verdict = self.service.shed(
                envoy_timeout_in(scope["headers"]), task=self.paths[scope["path"]]
            )
            if isinstance(verdict, Rejected):
                # Closed while draining, and for a client waiting for 100 Continue (its body
                # will not come: `expects_continue`), as the protocol closes them.
                close = self.service.admission.draining or expects_continue(scope["headers"])
                await send_rejection(verdict, scope["path"], send, started, close=close)
                return
            entry = scope[ENTRY] = verdict
        try:
            await self.app(scope, receive, send)
        finally:
            self.service.leave(entry)


async def send_rejection(
    rejection: Rejected, path: str, send: Send, started: float, close: bool
) -> None:
    """Answer a refusal to a request for `path` with its prebuilt response (the body is
    never read)."""
    status, headers, body = _shed_response(
        rejection.reason.value, rejection.retry_after_header, close, envelope_of(path)
    )
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"server-timing", shed_timing(started))],
        }
    )
    await send({"type": "http.response.body", "body": body})
