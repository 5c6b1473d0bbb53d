"""One request's answer as the client saw it, the error object it reports for it, and the
results it gives the request's items."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from app.batchclient.items import Failure, Request, Result


@dataclass(frozen=True, slots=True)
class Attempt:
    """One request's answer: ``status`` None when no HTTP response came (``transport``)."""

    status: int | None
    body: bytes
    retry_after_s: float | None
    latency_s: float
    ticket: int  # the AIMD controller's, from when it was sent
    transport: str | None = None  # "timeout" or the transport error's name


def error_of(attempt: Attempt) -> dict[str, Any]:
    """The server's ``error`` object when it sent one, else one describing what happened."""
    if attempt.status is None:
        return {"type": attempt.transport or "transport", "message": "no HTTP response"}
    try:
        parsed = orjson.loads(attempt.body)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        error: dict[str, Any] = parsed["error"]
        return error
    text = attempt.body[:1000].decode("utf-8", "replace")
    return {"type": "http_error", "message": text}


def results_of(request: Request, attempt: Attempt, attempts: int) -> list[Result] | None:
    """Each item's result from a 2xx, or None if the body is not the JSON expected (or
    fails an item: the answer is then retried like a fault)."""
    try:
        response = orjson.loads(attempt.body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(response, dict):
        return None
    results = request.unpack(response, attempts, attempt.latency_s)
    if any(isinstance(result, Failure) for result in results):
        return None
    return results


def failures_of(
    request: Request,
    attempt: Attempt,
    attempts: int,
    *,
    retryable: bool,
    reason: str | None = None,
) -> list[Result]:
    """Every item of the request failed with the attempt's error (``reason``: why the client
    gave up, when not the server's error alone)."""
    error = error_of(attempt)
    return [
        Failure(item.id, attempt.status, error, attempts, retryable=retryable, reason=reason)
        for item in request.items
    ]


def error_type_of(attempt: Attempt) -> str | None:
    """The error a non-2xx answer names (its ``error.code``, else ``error.type``: steadyserve
    sends both, equal but on the OpenAI routes), None for a 2xx or no response."""
    if attempt.status is None or 200 <= attempt.status < 300:
        return None
    error = error_of(attempt)
    kind = error.get("code") or error.get("type")
    return kind if isinstance(kind, str) else None
