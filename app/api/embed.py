"""POST /infer (native; a generate model's requests go on to `generate.py`) and the
OpenAI-compatible /v1/embeddings, /v1/models and /v1/models/{model}."""

from __future__ import annotations

import base64
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.api.cancellation import run_until_disconnect
from app.api.common import (
    body_as,
    body_document,
    envoy_timeout_ms,
    json_body,
    render,
    too_many_inputs,
    validated,
)
from app.api.errors import texts_as_sent
from app.api.errors_doc import CONNECTION_CAP, ERRORS, OPENAI_ERRORS
from app.api.generate import infer_generate
from app.api.responses import error_response, in_envelope_of, json_response, service_of
from app.embedding_service import EmbedResult, embed_texts
from app.schemas import (
    EmbeddingsRequest,
    EmbeddingsResponse,
    InferRequest,
    InferResponse,
    ModelCard,
    ModelList,
)
from app.schemas_generation import GenerateInferRequest, GenerateInferResponse
from app.service import Service, UnknownModel
from app.timing import PhaseTimer

router = APIRouter()


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
    chosen = service.resolve_model(model)
    work = embed_texts(
        service,
        chosen,
        texts,
        normalize=normalize,
        truncate=truncate,
        timeout_ms=timeout_ms,
        envoy_timeout_ms=envoy_timeout_ms(request),
        timer=timer,
    )
    return await run_until_disconnect(request, work)


# /infer's body is read once and validated by the model's task (the document names both).
INFER_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "anyOf": [
                        {"$ref": "#/components/schemas/InferRequest"},
                        {"$ref": "#/components/schemas/GenerateInferRequest"},
                    ]
                }
            }
        },
    }
}


def _asks_a_generate_model(service: Service, body: Any) -> bool:
    name = body.get("model") if isinstance(body, dict) else None
    if name is not None and not isinstance(name, str):
        return False  # refused as the embedding request it then is
    chosen = name or service.settings.default_model_name
    return chosen in service.model_names() and service.model_task(chosen) == "generate"


@router.post(
    "/infer",
    response_model=InferResponse | GenerateInferResponse,
    responses=ERRORS,
    openapi_extra=INFER_BODY_DOC,
)
async def infer(request: Request) -> Response:
    """Embeddings of the texts (an embedding model), or their continuations (a generate
    model), by the task of the model the request names. Served by `api/direct.py`; reads
    its own body so that the FastAPI route and the direct one run the same code."""
    body = await json_body(request)
    if _asks_a_generate_model(service_of(request), body):
        return await infer_generate(request, validated(request, GenerateInferRequest, body))
    return await _infer_embed(request, validated(request, InferRequest, body))


async def _infer_embed(request: Request, body: InferRequest) -> Response:
    texts = texts_as_sent(request, "inputs", body.inputs)
    if (too_many := too_many_inputs(request, len(texts), "inputs")) is not None:
        return too_many
    result = await _embed(
        request,
        body.model,
        texts,
        body.parameters.normalize,
        body.parameters.truncate,
        body.timeout_ms,
    )
    return render(
        request,
        {
            "model": result.model,
            "outputs": result.vectors,
            "usage": {"input_tokens": result.input_tokens, "inputs": len(texts)},
        },
    )


async def embeddings_request(request: Request) -> EmbeddingsRequest:
    """The body of a /v1/embeddings request, or the exception FastAPI raised for a parameter
    typed `EmbeddingsRequest` (tested against FastAPI itself)."""
    return await body_as(request, EmbeddingsRequest)


@router.post(
    "/v1/embeddings",
    response_model=EmbeddingsResponse,
    responses=OPENAI_ERRORS,
    openapi_extra=body_document(EmbeddingsRequest),
)
async def embeddings(request: Request) -> Response:
    # OpenAI's embeddings (no docstring: it would become the operation's description).
    # Served by `api/direct.py`; reads its own body, answering every body as FastAPI did for
    # a parameter typed `EmbeddingsRequest`, so the FastAPI route and the direct one run the
    # same code.
    body = await embeddings_request(request)
    texts = texts_as_sent(request, "input", body.input)
    if (too_many := too_many_inputs(request, len(texts), "input")) is not None:
        return too_many
    service = service_of(request)
    model = service.resolve_model(body.model)
    service.require_task(model, "embed")  # before `dimensions`: a width of another task
    width = service.output_width(model)
    if body.dimensions is not None and width is not None and body.dimensions != width:
        message = f"dimensions={body.dimensions} is not supported; {model} gives {width}"
        refused = error_response(400, "invalid_request", message, "dimensions")
        return in_envelope_of(request.url.path, refused)
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
    return render(
        request,
        {
            "object": "list",
            "data": data,
            "model": result.model,
            "usage": {"prompt_tokens": result.input_tokens, "total_tokens": result.input_tokens},
        },
    )


def _card(request: Request, name: str) -> dict[str, Any]:
    created: int = request.app.state.models_created
    return ModelCard(
        id=name, created=created, task=service_of(request).model_task(name)
    ).model_dump()


@router.get("/v1/models", response_model=ModelList, responses=CONNECTION_CAP)
async def models(request: Request) -> Response:
    cards = [_card(request, name) for name in service_of(request).model_names()]
    return json_response({"object": "list", "data": cards})


@router.get(
    "/v1/models/{model:path}",
    response_model=ModelCard,
    responses={404: OPENAI_ERRORS[404], **CONNECTION_CAP},
)
async def retrieve_model(request: Request, model: str) -> Response:
    # OpenAI's retrieve (`client.models.retrieve`); an unknown name is 404 `model_not_found`.
    # `:path`: `/v1/models/org/name` (a Hugging Face id) is a model not served here (names
    # have no `/`), answered as OpenAI answers one, not as an unknown route.
    service = service_of(request)
    if model not in service.model_names():
        raise UnknownModel(model, service.model_names())
    return json_response(_card(request, model))
