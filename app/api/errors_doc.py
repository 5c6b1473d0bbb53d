"""Every status the inference routes answer besides 200, as the OpenAPI document states it
(the handlers are in errors.py), and the connection cap's 429 of the other operations."""

from __future__ import annotations

from app.api.errors import RETRY_ELSEWHERE_HEADER
from app.schemas import ErrorBody

_ERROR_WHEN = {
    400: "Malformed JSON (`invalid_json`) or a body that is not UTF-8 (`http_error`); "
    "`dimensions` other than the model's width; "
    "generation asked of an embedding model, chat of a model without a chat template, or "
    "messages its template refuses, a stop string holding a special token's text beside "
    "other text, a tokenizer route's `model` left out where no model is picked for it "
    "(STEADY_DEFAULT_MODEL unset, and several generate models, or none and several models "
    "with a tokenizer), /detokenize's id outside the vocabulary (`invalid_request`); a "
    "prompt plus its new tokens over "
    "what one sequence holds, or a prompt over it in characters (`context_length_exceeded`).",
    404: "Unknown model (`model_not_found`).",
    413: "Body over STEADY_MAX_BODY_BYTES (`body_too_large`), too many inputs "
    "(`too_many_inputs`; /detokenize: over 131,072 token ids), an embedding input over the "
    "model's token limit, or a /tokenize text over the generation routes' character limit "
    "(`input_too_long`), or a "
    "generation needing more tokens than STEADY_RATE_LIMIT_BURST (`too_many_tokens`).",
    415: "A compressed body (`unsupported_content_encoding`): send it uncompressed.",
    422: "Wrong types, empty input or unknown fields (`invalid_request`, with `param`).",
    408: "The body did not arrive within STEADY_BODY_READ_TIMEOUT_S (`body_timeout`), or "
    "the headers within 10 s of the request's first byte (`header_timeout`).",
    431: "The request line and headers over 64 KiB, or spread over more than 1,024 reads "
    "(`headers_too_large`).",
    429: "Over the token rate (`rate`), the in-flight cap (`inflight`), or a predicted wait "
    "over STEADY_MAX_QUEUE_DELAY_MS (`queue`), often before the body is read; a front end "
    "holding STEADY_MAX_CONNECTIONS connections (`connections`: this connection is closed). "
    "`Retry-After` says when to retry.",
    500: "A fault of the server's own (`internal_error`, `non_finite_output`), or a sticky "
    "CUDA error in the request's batch, which restarts the engine (`device_lost`: an input of "
    "the batch may have caused it; do not resend it unchanged).",
    503: "Warming up or start-up failed (`not_ready`; a tokenizer route's generate model "
    "until its engine has reported it), the engine exited or stopped answering "
    "with the request in it (`engine_lost`, retry), or draining (`draining`).",
    504: "The request's deadline (`timeout_ms`, else Envoy's x-envoy-expected-rq-timeout-ms, "
    "else STEADY_DEFAULT_TIMEOUT_MS) passed before its inputs were computed (`deadline`).",
}
# The headers of a refusal (`errors.refusal_headers`, `shedding.raw_refusal`), by status.
REFUSAL_HEADERS: dict[str, dict[str, object]] = {
    "Retry-After": {
        "description": "Whole seconds to wait before retrying, where waiting would help.",
        "schema": {"type": "integer", "minimum": 1},
    },
    RETRY_ELSEWHERE_HEADER: {
        "description": "`1`: the request did no work, so another replica may take it at once "
        "(the shipped Envoy retries the answers that carry it); absent where it may have "
        "reached an engine (`engine_lost`, an engine that stopped answering).",
        "schema": {"type": "string", "enum": ["1"]},
    },
    "Connection": {
        "description": "`close`: the connection is closed after this answer (at the "
        "connection cap, while draining, or where the request's body was not read).",
        "schema": {"type": "string"},
    },
}
ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorBody, "description": when}
    | ({"headers": REFUSAL_HEADERS} if code in (429, 503) else {})
    for code, when in _ERROR_WHEN.items()
}
# What every operation but Prometheus's scrape may be answered on a front end holding
# STEADY_MAX_CONNECTIONS connections: its HTTP protocol refuses it from the headers
# (`api/shedding_protocol.py`).
CONNECTION_CAP: dict[int | str, dict[str, object]] = {
    429: {
        "model": ErrorBody,
        "description": "A front end holding STEADY_MAX_CONNECTIONS connections "
        "(`connections`: this connection is closed). `Retry-After` says when to retry.",
        "headers": REFUSAL_HEADERS,
    }
}
# The OpenAI routes answer a refused field 400, as OpenAI does (`errors.invalid_request_status`).
OPENAI_ERRORS: dict[int | str, dict[str, object]] = {
    **{code: answer for code, answer in ERRORS.items() if code != 422},
    400: {
        "model": ErrorBody,
        "description": f"{_ERROR_WHEN[400]} Wrong types, empty input or unknown fields "
        "(`invalid_request`, with `param`).",
    },
}
