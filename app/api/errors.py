"""Every exception a request can raise, mapped once to its status and JSON error body.

Client mistakes are 4xx with the offending parameter named; capacity is 429 with
`Retry-After`; not ready / draining is 503; a passed deadline is 504. Only a fault of the
server itself becomes a 500: a failed batch's here, logged at most once per
`BATCH_FAILED_LOG_INTERVAL_S` (the engine logged its traceback), any other fault by
`ServerTimingMiddleware`, with its traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from app.admission import Rejected, RejectReason
from app.api.cancellation import ClientDisconnected
from app.api.responses import error_response, in_envelope_of, speaks_openai
from app.engine.client import EngineNotConnected, EngineRefused, EngineUnavailable
from app.failures import BatchFailed, DeadlineExceeded, DeviceLost, NonFiniteOutput
from app.generation.chat import ChatTemplateError, SpecialTokenInMessage
from app.generation.errors import (
    ContextTooLong,
    ModelNotChosen,
    NoChatTemplate,
    StopHoldsSpecialToken,
    TokenIdOutOfVocabulary,
    TooManyTokens,
)
from app.log_limits import Throttle
from app.models.tokenizer import InputTooLong
from app.service import UnknownModel, WrongTask

log = logging.getLogger(__name__)

REJECTION_STATUS = {
    RejectReason.RATE: 429,
    RejectReason.INFLIGHT: 429,
    RejectReason.QUEUE: 429,
    # A front end's connection cap is its capacity, as the in-flight cap is (503 is for a
    # server that cannot serve at all); only its HTTP protocol answers it
    # (api/shedding_protocol.py).
    RejectReason.CONNECTIONS: 429,
    RejectReason.DRAINING: 503,
    RejectReason.NOT_READY: 503,
    RejectReason.ENGINE_LOST: 503,
    RejectReason.DEADLINE: 504,
}

# On a refusal another replica may serve at once (`RejectReason.retry_elsewhere`): the shipped
# Envoy retries the answers that carry it (`retriable_headers`), and only those.
RETRY_ELSEWHERE_HEADER = "x-steadyserve-retry-elsewhere"


def refusal_headers(reason: RejectReason, retry_after: str | None) -> dict[str, str]:
    """The headers of a refusal: its `Retry-After`, and whether to retry it elsewhere."""
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    if reason.retry_elsewhere:
        headers[RETRY_ELSEWHERE_HEADER] = "1"
    return headers


def engine_unavailable_headers(error: EngineUnavailable) -> dict[str, str]:
    """A 503 `not_ready`'s headers: retried elsewhere only when nothing reached an engine (an
    engine that stopped answering may have been stopped by this very request)."""
    if isinstance(error, EngineNotConnected):
        return refusal_headers(RejectReason.NOT_READY, "1")
    return {"Retry-After": "1"}


# nginx's convention for "client closed request": the client never sees it; the HTTP metrics
# (a 4xx) and a slow request's report do (no log line: README's table of statuses).
CLIENT_CLOSED_REQUEST = 499


# Names pydantic gives the member of a union it tried, which look like field names.
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _param(location: tuple[int | str, ...]) -> str | None:
    # pydantic names the member of a union it tried ("constrained-str", "list[...]", "str")
    # in the location: not a field of the request.
    parts = [
        str(p)
        for p in location
        if isinstance(p, int) or (p != "body" and p.isidentifier() and p not in _UNION_MEMBER_TAGS)
    ]
    if not parts:
        return None
    text = parts[0]
    for part in parts[1:]:
        text += f"[{part}]" if part.isdigit() else f".{part}"
    return text


async def _validation_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    errors = error.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(400, "invalid_json", "request body is not valid JSON")
    # For a union (`stop`: a string or a list), the member whose type the input has says
    # what is wrong ("at most 4 items"), not the one it is not ("a valid string").
    said = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    # Else the most precise: `inputs: [5]` is wrong at inputs[0], not at inputs.
    candidates = said or sorted(errors, key=lambda e: -len(_param(tuple(e.get("loc", ()))) or ""))
    first = (candidates or [{"msg": "invalid request", "loc": ()}])[0]
    param = _param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "missing" and param:
        message = f"field required: {param}"
    return error_response(
        invalid_request_status(request.url.path), "invalid_request", message, param
    )


def invalid_request_status(path: str) -> int:
    """The status of a body that parses but is refused (a wrong type, an unknown field, a
    value not served): 400 on the OpenAI routes, as OpenAI (and vLLM) answer it, which the
    openai client raises as `BadRequestError` (a 422 was its `UnprocessableEntityError`,
    which a caller's handler of bad requests missed); FastAPI's 422 elsewhere."""
    return 400 if speaks_openai(path) else 422


async def _rejected(request: Request, error: Exception) -> Response:
    assert isinstance(error, Rejected)
    headers = refusal_headers(error.reason, error.retry_after_header)
    return error_response(
        REJECTION_STATUS[error.reason], error.reason.value, error.message, headers=headers
    )


async def _deadline(request: Request, error: Exception) -> Response:
    # Its own words where it has them: a generation ended "after N generated tokens".
    message = str(error) or "deadline passed before the request was computed"
    return error_response(504, "deadline", message)


@dataclass(frozen=True, slots=True)
class TextsAsSent:
    """How a request's texts came: in field `field`, as a list or as one string."""

    field: str
    as_list: bool


def texts_as_sent(request: Request, field: str, value: str | list[str]) -> list[str]:
    """The texts of the request's field `field` (one string: a list of one), noting how
    the client sent them: an error about one of them names it as sent, `prompt` for a
    string and `prompt[3]` for a list's element (`prompt[0]` named a field never sent as a
    list). Event loop thread, before the texts are checked."""
    request.state.texts_as_sent = TextsAsSent(field, isinstance(value, list))
    return value if isinstance(value, list) else [value]


def token_prompts_as_sent(
    request: Request, field: str, value: list[int] | list[list[int]]
) -> list[list[int]]:
    """`texts_as_sent` for token-id prompts: a list of ids is one prompt (named `prompt`, as
    a string is), a list of such lists several (`prompt[3]`)."""
    one = isinstance(value[0], int)
    request.state.texts_as_sent = TextsAsSent(field, not one)
    return [cast(list[int], value)] if one else cast(list[list[int]], value)


def _text_param(request: Request, index: int) -> str | None:
    sent: TextsAsSent | None = getattr(request.state, "texts_as_sent", None)
    if sent is None:
        return None
    return f"{sent.field}[{index}]" if sent.as_list else sent.field


def _named_as_sent(request: Request, noun: str, index: int) -> str:
    """How a message names text `index` (`noun`: input, prompt): by its index only where
    the client sent a list (`prompt 0` of a prompt sent as one string read as an index into
    nothing)."""
    sent: TextsAsSent | None = getattr(request.state, "texts_as_sent", None)
    if sent is None or sent.as_list:
        return f"{noun} {index}"
    if sent.field == "messages":  # chat: one prompt, rendered by the chat template
        return f"the {noun} rendered from the messages"
    return f"the {noun}"


async def _too_long(request: Request, error: Exception) -> Response:
    # An embedding input: a generation prompt over its limit, in tokens or in characters,
    # is a `ContextTooLong` (400 `context_length_exceeded`), whatever its route.
    assert isinstance(error, InputTooLong)
    param = _text_param(request, error.index)
    message = error.described(_named_as_sent(request, "input", error.index))
    if speaks_openai(request.url.path) or error.unit == "characters":
        return error_response(413, "input_too_long", message, param)
    message = f"{message}; set parameters.truncate to cut inputs to the limit"
    return error_response(413, "input_too_long", message, param)


async def _context_too_long(request: Request, error: Exception) -> Response:
    assert isinstance(error, ContextTooLong)
    param = _text_param(request, error.index)
    message = error.described(_named_as_sent(request, "prompt", error.index))
    return error_response(400, "context_length_exceeded", message, param)


async def _unknown_token_id(request: Request, error: Exception) -> Response:
    assert isinstance(error, TokenIdOutOfVocabulary)
    param = _text_param(request, error.index)
    message = error.described(_named_as_sent(request, "prompt", error.index))
    return error_response(400, "invalid_request", message, param)


async def _too_many_tokens(request: Request, error: Exception) -> Response:
    return error_response(413, "too_many_tokens", str(error))


async def _chat_refused(request: Request, error: Exception) -> Response:
    # A special token's text names the field that holds it (`messages[1].content`).
    param = error.field if isinstance(error, SpecialTokenInMessage) else "messages"
    return error_response(400, "invalid_request", str(error), param)


async def _stop_refused(request: Request, error: Exception) -> Response:
    param = "stop" if speaks_openai(request.url.path) else "parameters.stop"  # /infer's
    return error_response(400, "invalid_request", str(error), param)


async def _engine_refused(request: Request, error: Exception) -> Response:
    assert isinstance(error, EngineRefused)
    index = error.input_index
    param = None if index is None else _text_param(request, index)
    return error_response(400, "invalid_request", str(error), param)


async def _engine_unavailable(request: Request, error: Exception) -> Response:
    assert isinstance(error, EngineUnavailable)
    headers = engine_unavailable_headers(error)
    return error_response(503, RejectReason.NOT_READY.value, str(error), headers=headers)


async def _unknown_model(request: Request, error: Exception) -> Response:
    return error_response(404, "model_not_found", str(error), "model")


async def _wrong_task(request: Request, error: Exception) -> Response:
    # And a tokenizer route's model left out where no model is picked (`ModelNotChosen`).
    return error_response(400, "invalid_request", str(error), "model")


async def _client_gone(request: Request, error: Exception) -> Response:
    return error_response(CLIENT_CLOSED_REQUEST, "client_closed_request", "client disconnected")


# A failed batch fails each of its requests: one line per this many seconds says so (the
# engine logged the batch's traceback, once), not a traceback per request.
BATCH_FAILED_LOG_INTERVAL_S = 10.0
_batch_failures = Throttle(BATCH_FAILED_LOG_INTERVAL_S)


def described(scope: Scope) -> str:
    """A request as the front end's 5xx log lines name it: its method and path, the path as
    `repr` shows it (decoded from %-escapes, it may hold a line end that would forge a log
    line of its own), and Envoy's `x-request-id` where it carries one (as `repr` shows it
    too), which finds the request in the proxy's access log."""
    line = f"{scope.get('method')} {scope.get('path', '')!r}"
    envoy_id = Headers(scope=scope).get("x-request-id")
    return line if envoy_id is None else f"{line} x-request-id={envoy_id!r}"


def log_batch_failed(request: str, error: BatchFailed) -> None:
    """Say that `request` (`described`, or the stream it was in) was answered 500 for its
    failed batch, at most once per `BATCH_FAILED_LOG_INTERVAL_S`, with how many others were
    since the last line."""
    if _batch_failures.allow():
        held = _batch_failures.take_held()
        more = f"; {held} more since the last such line" if held else ""
        log.error("batch failed, 500 to %s: %s%s", request, error, more)


async def _batch_failed(request: Request, error: Exception) -> Response:
    assert isinstance(error, BatchFailed)
    log_batch_failed(described(request.scope), error)
    # As `ServerTimingMiddleware` answers any other fault of the server's own.
    return error_response(500, "internal_error", "internal server error")


async def _non_finite(request: Request, error: Exception) -> Response:
    return error_response(500, "non_finite_output", str(error))


async def _device_lost(request: Request, error: Exception) -> Response:
    # Its batch lost the engine its device, and may hold the input that did: no `Retry-After`
    # (the engine's other requests are answered 503 `engine_lost`, retry).
    return error_response(500, "device_lost", str(error))


# The error type of an HTTP exception (Starlette's routing, a body that cannot be read), by
# status; any other status is `HTTP_ERROR` (a body that is not valid UTF-8, 400).
HTTP_ERROR_TYPES = {
    404: "not_found",
    405: "method_not_allowed",
    415: "unsupported_content_encoding",
}
HTTP_ERROR = "http_error"


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, StarletteHTTPException)
    kind = HTTP_ERROR_TYPES.get(error.status_code, HTTP_ERROR)
    return error_response(error.status_code, kind, str(error.detail), headers=error.headers)


Handler = Callable[[Request, Exception], Awaitable[Response]]


def _in_envelope_of_the_path(handler: Handler) -> Handler:
    async def answer(request: Request, error: Exception) -> Response:
        return in_envelope_of(request.url.path, await handler(request, error))

    return answer


def install_error_handlers(app: FastAPI) -> None:
    """Every handler's answer in the envelope of the protocol its path belongs to."""
    for kind, handler in _HANDLERS.items():
        app.add_exception_handler(kind, _in_envelope_of_the_path(handler))


_HANDLERS: dict[type[Exception], Handler] = {
    RequestValidationError: _validation_error,
    Rejected: _rejected,
    DeadlineExceeded: _deadline,
    InputTooLong: _too_long,
    UnknownModel: _unknown_model,
    WrongTask: _wrong_task,
    ModelNotChosen: _wrong_task,
    NoChatTemplate: _chat_refused,
    ChatTemplateError: _chat_refused,
    StopHoldsSpecialToken: _stop_refused,
    ContextTooLong: _context_too_long,
    TokenIdOutOfVocabulary: _unknown_token_id,
    TooManyTokens: _too_many_tokens,
    EngineRefused: _engine_refused,
    EngineUnavailable: _engine_unavailable,
    ClientDisconnected: _client_gone,
    BatchFailed: _batch_failed,
    NonFiniteOutput: _non_finite,
    DeviceLost: _device_lost,
    StarletteHTTPException: _http_error,
}
