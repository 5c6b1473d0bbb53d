"""What every inference route shares: Envoy's deadline header, reading a JSON body (UTF-8
only, the same for /infer, /v1/embeddings and the generation routes) and validating it
(timed as the `parse_body` phase), the input-count limit, and rendering an answer as JSON
(timed as the `serialise` phase)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any, TypeVar

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from app.admission import Entry
from app.api.responses import error_response, in_envelope_of, json_response, service_of
from app.timing import PhaseTimer

ENVOY_TIMEOUT_HEADER = b"x-envoy-expected-rq-timeout-ms"

Schema = TypeVar("Schema", bound=BaseModel)

# Scope key: the `admission.Entry` of a request `Service.shed` let in from its headers (set by
# api/shedding.py); its body counts in flight once read (`count_body_in`).
ENTRY = "steadyserve.entry"


def envoy_timeout_in(headers: Iterable[tuple[bytes, bytes]]) -> float | None:
    """The deadline Envoy announces for a request, in ms, from its raw ASGI headers (names
    lower-cased); None without one or when it is not a number."""
    for name, value in headers:
        if name == ENVOY_TIMEOUT_HEADER:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def expects_continue(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request's client waits for `100 Continue` before sending its body (raw
    ASGI headers, names lower-cased). One answered without reading that body must close
    its connection: the client will not send the body, and the HTTP parser, still waiting
    for the bytes it declared, would take the client's next request as them."""
    return any(
        name == b"expect" and value.strip().lower() == b"100-continue" for name, value in headers
    )


def envoy_timeout_ms(request: Request) -> float | None:
    return envoy_timeout_in(request.scope["headers"])


def too_many_inputs(
    request: Request, count: int, param: str, *, what: str = "inputs", limit: int | None = None
) -> Response | None:
    """The 413 of a request of `count` inputs (`what`, as the message names them) over
    `limit`, by default STEADY_MAX_INPUTS_PER_REQUEST (in its path's envelope), else None."""
    if limit is None:
        limit = service_of(request).settings.max_inputs_per_request
    if count <= limit:
        return None
    message = f"{count} {what}; at most {limit} per request"
    return in_envelope_of(request.url.path, error_response(413, "too_many_inputs", message, param))


def render(request: Request, content: Any) -> Response:
    """The JSON answer, its rendering timed as the `serialise` phase."""
    started = time.perf_counter()
    response = json_response(content)
    timer: PhaseTimer = request.state.server_timing
    timer.add("serialise", time.perf_counter() - started)
    return response


class BodyParsePhase:
    """Times the work inside as the request's `parse_body` phase: turning its body's bytes
    into what the route reads (JSON decoding, validation), on the event loop, where a large
    body's parse holds the loop as rendering a large answer does (`serialise`). Counted
    whether the body parses or is refused. Without a `PhaseTimer` (an app without
    `ServerTimingMiddleware`) nothing is timed. Event loop thread. (A class, not a
    generator: it runs up to twice on every request of the hot routes.)"""

    __slots__ = ("_started", "_timer")

    def __init__(self, request: Request) -> None:
        self._timer: PhaseTimer | None = getattr(request.state, "server_timing", None)
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc_info: object) -> None:
        if self._timer is not None:
            self._timer.add("parse_body", time.perf_counter() - self._started)


def count_body_in(request: Request) -> None:
    """The request's body has been read: count it in flight (`Service.body_arrived`) if it
    was let in from its headers; raises `Rejected` (429 `inflight`) for one whose body came
    so late that the in-flight cap filled meanwhile. Event loop thread."""
    entry: Entry | None = request.scope.get(ENTRY)
    if entry is not None:
        rejection = service_of(request).body_arrived(entry)
        if rejection is not None:
            raise rejection


async def json_body(request: Request) -> Any:
    """The request's body as FastAPI parses a required `Body()` parameter: JSON when the
    content type says so (`application/json` or `application/*+json`), else the raw bytes
    (which the schema then refuses). An empty body is `missing` and JSON that does not
    parse is `json_invalid` (`RequestValidationError`, answered 422/400 by api/errors.py);
    a body that cannot be read or decoded at all is a 400 `HTTPException`. (A compressed
    one never gets here: `BodyGuardMiddleware` answers it 415.) Once read, the body counts
    in flight (`count_body_in`), which may raise `Rejected`."""
    try:
        raw = await request.body()
    except Exception as error:  # a broken stream (the body guard's limits included)
        raise HTTPException(400, "There was an error parsing the body") from error
    count_body_in(request)  # before any work is spent on it
    with BodyParsePhase(request):
        return _decoded(request, raw)


def _decoded(request: Request, raw: bytes) -> Any:
    """`raw` as `json_body` reads it (its contract); raises `RequestValidationError` or
    `HTTPException`."""
    try:
        content_type = request.headers.get("content-type", "")
        kind, _, subtype = content_type.partition(";")[0].strip().lower().partition("/")
        is_json = kind == "application" and (subtype == "json" or subtype.endswith("+json"))
        # UTF-8 only (RFC 8259; a leading BOM is ignored, as it allows): json.loads would
        # guess UTF-16 or UTF-32 from the bytes.
        body: Any = json.loads(raw.decode("utf-8-sig")) if raw and is_json else raw
    except json.JSONDecodeError as error:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", error.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": error.msg},
                }
            ]
        ) from None
    except Exception as error:  # undecodable bytes, nesting too deep
        raise HTTPException(400, "There was an error parsing the body") from error
    if not raw:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    return body


def validated(
    request: Request, schema: type[Schema], body: Any, *, from_attributes: bool = False
) -> Schema:
    """`request`'s `body` as `schema` (timed as its `parse_body` phase), or the 422 FastAPI
    itself would answer. `from_attributes=True` validates as FastAPI validates a parameter
    typed as the model (the message for a body that is not an object differs); without it,
    as a `Body()` validated afterwards."""
    try:
        with BodyParsePhase(request):
            return schema.model_validate(body, from_attributes=from_attributes)
    except ValidationError as error:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in error.errors()]
        raise RequestValidationError(errors) from None


async def body_as(request: Request, schema: type[Schema]) -> Schema:
    """The request's body (`json_body`) as `schema`, answered as FastAPI answers a body
    parameter typed `schema`, except that the body must be UTF-8: the routes read their own
    body so that every inference route decodes it the same way."""
    return validated(request, schema, await json_body(request), from_attributes=True)


def body_document(schema: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` naming `schema` as its JSON body, as FastAPI names a body
    parameter (the component itself: api/openapi.py)."""
    return {
        "requestBody": {
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{schema.__name__}"}}
            },
            "required": True,
        }
    }
