"""POST /infer (native) and the OpenAI-compatible /v1/embeddings and /v1/models."""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from app.api.cancellation import run_until_disconnect
from app.api.responses import error_response, json_response, service_of
from app.schemas import (
    EmbeddingsRequest,
    EmbeddingsResponse,
    ErrorBody,
    InferRequest,
    InferResponse,
    ModelCard,
    ModelList,
)
from app.service import EmbedResult, Service
from app.timing import PhaseTimer

router = APIRouter()

ENVOY_TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"

# Every status these routes answer besides 200, as the OpenAPI document states it.
_ERROR_WHEN = {
    400: "Malformed JSON (`invalid_json`); `dimensions` other than the model's width.",
    404: "Unknown model (`model_not_found`).",
    413: "Body over STEADY_MAX_BODY_BYTES (`body_too_large`), too many inputs "
    "(`too_many_inputs`), or an input over the model's token limit (`input_too_long`).",
    422: "Wrong types, empty input or unknown fields (`invalid_request`, with `param`).",
    408: "The body did not arrive within STEADY_BODY_READ_TIMEOUT_S (`body_timeout`).",
    429: "Over the token rate (`rate`), the in-flight cap (`inflight`), or a predicted wait "
    "over STEADY_MAX_QUEUE_DELAY_MS (`queue`), often before the body is read; `Retry-After` "
    "says when to retry.",
    500: "A fault of the server's own (`internal_error`, `non_finite_output`).",
    503: "Warming up or start-up failed (`not_ready`), the engine restarted with the request "
    "in it (`engine_lost`, retry), or draining (`draining`).",
    504: "The request's deadline (`timeout_ms`, else Envoy's x-envoy-expected-rq-timeout-ms, "
    "else STEADY_DEFAULT_TIMEOUT_MS) passed before its inputs were computed (`deadline`).",
}
_ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorBody, "description": when} for code, when in _ERROR_WHEN.items()
}


class NonFiniteOutput(Exception):
    """The model gave a NaN or infinite value: a fault of the server's (answered 500), never
    rendered, since JSON has no NaN (orjson would write `null`)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"{model} produced a non-finite value (NaN or infinity)")


def envoy_timeout_ms(request: Request) -> float | None:
    value = request.headers.get(ENVOY_TIMEOUT_HEADER)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _too_many_inputs(service: Service, count: int, param: str) -> Response | None:
    limit = service.settings.max_inputs_per_request
    if count <= limit:
        return None
    return error_response(
        413, "too_many_inputs", f"{count} inputs; at most {limit} per request", param
    )


async def _embed(
    request: Request,
    model: str | None,
    texts: list[str],
    normalize: bool,
    truncate: bool,
    timeout_ms: float | None,
) -> EmbedResult:
    service = service_of(request)
    timer: PhaseTimer = request.state.server_timing
    work = service.embed(
        service.resolve_model(model),
        texts,
        normalize=normalize,
        truncate=truncate,
        timeout_ms=timeout_ms,
        envoy_timeout_ms=envoy_timeout_ms(request),
        timer=timer,
    )
    result = await run_until_disconnect(request, work)
    if not np.isfinite(result.vectors).all():
        raise NonFiniteOutput(result.model)
    return result


def _render(request: Request, content: Any) -> Response:
    """The JSON answer, its rendering timed as the `serialise` phase."""
    started = time.perf_counter()
    response = json_response(content)
    timer: PhaseTimer = request.state.server_timing
    timer.add("serialise", time.perf_counter() - started)
    return response


@router.post("/infer", response_model=InferResponse, responses=_ERRORS)
async def infer(request: Request, body: InferRequest) -> Response:
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if (too_many := _too_many_inputs(service_of(request), len(texts), "inputs")) is not None:
        return too_many
    result = await _embed(
        request,
        body.model,
        texts,
        body.parameters.normalize,
        body.parameters.truncate,
        body.timeout_ms,
    )
    return _render(
        request,
        {
            "model": result.model,
            "outputs": result.vectors,
            "usage": {"input_tokens": result.input_tokens, "inputs": len(texts)},
        },
    )


@router.post("/v1/embeddings", response_model=EmbeddingsResponse, responses=_ERRORS)
async def embeddings(request: Request, body: EmbeddingsRequest) -> Response:
    texts = [body.input] if isinstance(body.input, str) else body.input
    if (too_many := _too_many_inputs(service_of(request), len(texts), "input")) is not None:
        return too_many
    service = service_of(request)
    model = service.resolve_model(body.model)
    width = service.output_width(model)
    if body.dimensions is not None and width is not None and body.dimensions != width:
        return error_response(
            400,
            "invalid_request",
            f"dimensions={body.dimensions} is not supported; {model} gives {width}",
            "dimensions",
        )
    result = await _embed(request, model, texts, True, False, None)
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            if body.encoding_format == "base64"
            else vector,
        }
        for index, vector in enumerate(result.vectors)
    ]
    return _render(
        request,
        {
            "object": "list",
            "data": data,
            "model": result.model,
            "usage": {"prompt_tokens": result.input_tokens, "total_tokens": result.input_tokens},
        },
    )


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> Response:
    service = service_of(request)
    cards = [
        ModelCard(id=name, task=service.model_task(name)).model_dump()
        for name in service.model_names()
    ]
    return json_response({"object": "list", "data": cards})
