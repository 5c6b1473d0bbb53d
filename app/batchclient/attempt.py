"""One request's answer as the client saw it, and the error object it reports for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


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
