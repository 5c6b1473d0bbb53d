"""The OpenAPI document at /openapi.json, made to state what this server enforces.

FastAPI's document comes from the pydantic models alone; limits that come from settings or
from the loaded model are added here, so that a request valid by the document is one the
server accepts (schemathesis checks this in tests/e2e/test_openapi_e2e.py):

- the list forms of `inputs` / `input` get `maxItems` = `STEADY_MAX_INPUTS_PER_REQUEST`;
- `dimensions` of /v1/embeddings is narrowed to the served models' output widths once they
  are loaded (until then the document is rebuilt on each request and not cached);
- /v1/embeddings and the generation routes read their own body (`api/common.py::body_as`):
  their request schemas are the components FastAPI writes for `EmbeddingsRequest`,
  `CompletionRequest` and `ChatCompletionRequest` body parameters, as before;
- /infer's body is either request model (it is validated by the named model's task); each
  request's `model` is narrowed to the served models of its task (chat: generate models
  with a chat template), absent, null or "" (the default model) only where the default is
  one; a route or /infer form that no served model answers is not documented; the
  tokenizer routes likewise (`openapi_tokenize.py`);

- the fields the OpenAI routes read null as the default of (`NULL_MEANS_DEFAULT`) take null;
- a streamed answer's chunk objects (`schemas_stream.py`) are components where its route is;
- FastAPI's 422 `HTTPValidationError`, which it states for every route with a parameter, is
  dropped with its components: /v1/models/{model}'s path takes any string, and the
  inference routes' 422 is the `ErrorBody` they document themselves.

What JSON Schema cannot state (an input's token count, the deadline) is answered with the
documented 413 and 504 responses. Called on the event loop thread (the /openapi.json route).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from app.api.openapi_tokenize import document_tokenizer_routes
from app.generation.tokenizer import GenerationTokenizer
from app.schemas import EmbeddingsRequest, InferRequest
from app.schemas_generation import (
    NULL_MEANS_DEFAULT,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateInferRequest,
)
from app.schemas_stream import ChatCompletionChunk, CompletionChunk
from app.schemas_tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from app.service import Service

STREAMED_CHUNKS = {
    "/v1/completions": CompletionChunk,
    "/v1/chat/completions": ChatCompletionChunk,
}

TOKENIZER_BODIES = (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)

# (component, field) of every request field that takes one text or a list of texts.
_TEXT_LIST_FIELDS = (
    ("InferRequest", "inputs"),
    ("EmbeddingsRequest", "input"),
    ("GenerateInferRequest", "inputs"),
    ("CompletionRequest", "prompt"),
)


def _add_component(components: dict[str, Any], model: type[BaseModel]) -> None:
    """`model`'s schema, and those it refers to that are not components already."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, referred in schema.pop("$defs", {}).items():
        components.setdefault(name, referred)
    components[model.__name__] = schema


def _body_components(*models: type[BaseModel]) -> dict[str, Any]:
    """The components FastAPI writes for `models` as the body parameter of a route, for the
    routes that read their own body (`api/direct.py`): their document stays the one FastAPI
    gave them when it read the body itself."""
    routes = []
    for model in models:

        async def takes(body: Any) -> None:
            """Never called: documents `model` as a body."""

        takes.__annotations__ = {"body": model, "return": None}
        routes.append(APIRoute(f"/{model.__name__}", takes, methods=["POST"]))
    document = get_openapi(title="", version="", routes=routes)
    # With the throwaway routes' own 422 answer (`_drop_fastapi_validation_errors`).
    components: dict[str, Any] = document["components"]["schemas"]
    return components


def _narrow_model(component: dict[str, Any], models: list[str], default: str) -> None:
    """`model` names one of `models`; it may be left out, null or empty (the server reads ""
    as the default too: `Service.resolve_model`) only when the default is one."""
    if default in models:
        component["properties"]["model"] = {
            "anyOf": [{"type": "string", "enum": [*models, ""]}, {"type": "null"}],
            "description": "A served model that can answer this; the default model if "
            "absent, null or empty.",
        }
        return
    component["properties"]["model"] = {
        "type": "string",
        "enum": models,
        "description": "A served model that can answer this.",
    }
    component["required"] = sorted({*component.get("required", []), "model"})


def _document_tasks(
    document: dict[str, Any], tasks: dict[str, list[str]], chatting: list[str], default: str
) -> None:
    """Each request for the served models of its task (`tasks`: their names by task): a
    route, or /infer form, that none of them answers not at all; chat only for the generate
    models with a chat template."""
    components = document["components"]["schemas"]
    paths = document["paths"]
    requests = [
        ("/v1/embeddings", "EmbeddingsRequest", tasks.get("embed", [])),
        ("/v1/completions", "CompletionRequest", tasks.get("generate", [])),
        ("/v1/chat/completions", "ChatCompletionRequest", chatting),
        (None, "InferRequest", tasks.get("embed", [])),  # /infer's two forms
        (None, "GenerateInferRequest", tasks.get("generate", [])),
    ]
    for path, component, models in requests:
        if models:
            _narrow_model(components[component], models, default)
            continue
        components.pop(component, None)
        if path is not None:
            paths.pop(path, None)
    forms = [
        {"$ref": f"#/components/schemas/{name}"}
        for name in ("InferRequest", "GenerateInferRequest")
        if name in components
    ]
    if not forms:
        paths.pop("/infer", None)
        return
    body = paths["/infer"]["post"]["requestBody"]["content"]["application/json"]
    body["schema"] = forms[0] if len(forms) == 1 else {"anyOf": forms}


def _null_means_default(components: dict[str, Any]) -> None:
    """The fields of the OpenAI generation requests that take null for their default."""
    for model in (CompletionRequest, ChatCompletionRequest):
        properties = components.get(model.__name__, {}).get("properties", {})
        for name in NULL_MEANS_DEFAULT & properties.keys():
            schema = properties[name]
            if {"type": "null"} in schema.get("anyOf", []):
                continue
            annotations = {
                key: schema.pop(key) for key in ("title", "description", "default") if key in schema
            }
            properties[name] = {"anyOf": [schema, {"type": "null"}], **annotations}


def _drop_fastapi_validation_errors(document: dict[str, Any]) -> None:
    fastapi_422 = {"$ref": "#/components/schemas/HTTPValidationError"}
    for operations in document["paths"].values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            answer = responses.get("422", {}).get("content", {}).get("application/json", {})
            if answer.get("schema") == fastapi_422:
                del responses["422"]
    for name in ("HTTPValidationError", "ValidationError"):
        document["components"]["schemas"].pop(name, None)


def _limit_text_lists(components: dict[str, Any], max_items: int) -> None:
    for component, field in _TEXT_LIST_FIELDS:
        if component not in components:
            continue
        for variant in components[component]["properties"][field]["anyOf"]:
            # A list of token ids is one prompt: its length is the context limit's business.
            if variant.get("type") == "array" and variant["items"].get("type") != "integer":
                variant["maxItems"] = max_items


def _narrow_dimensions(components: dict[str, Any], widths: list[int]) -> None:
    dimensions = components["EmbeddingsRequest"]["properties"]["dimensions"]
    dimensions["anyOf"] = [{"type": "integer", "enum": widths}, {"type": "null"}]
    dimensions["description"] = (
        "Must equal the model's output width (the served models give "
        f"{', '.join(map(str, widths))}); vectors are not shortened."
    )


def install_openapi(app: FastAPI, service: Service) -> None:
    """Replace `app.openapi` with the document described in the module docstring."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(
            title=app.title, version=app.version, openapi_version=app.openapi_version,
            routes=app.routes,
        )  # fmt: skip
        # In FastAPI's order (by name), as when it read these routes' bodies itself.
        fastapi_components = document["components"]["schemas"]
        read_by_routes = _body_components(
            EmbeddingsRequest, CompletionRequest, ChatCompletionRequest
        )
        components = dict(sorted({**fastapi_components, **read_by_routes}.items()))
        document["components"]["schemas"] = components
        _add_component(components, InferRequest)
        _add_component(components, GenerateInferRequest)
        for tokenizer_body in TOKENIZER_BODIES:  # read by api/tokenize.py itself
            _add_component(components, tokenizer_body)
        names = service.model_names()
        tasks: dict[str, list[str]] = {}
        for name in names:
            tasks.setdefault(service.model_task(name), []).append(name)
        chatting = [
            name
            for name in tasks.get("generate", [])
            if isinstance(tokenizer := service.tokenizers.get(name), GenerationTokenizer)
            and tokenizer.chat_template is not None
        ]
        _document_tasks(document, tasks, chatting, service.settings.default_model_name)
        document_tokenizer_routes(document, service, chatting, _narrow_model)
        for path, chunk in STREAMED_CHUNKS.items():  # what `streamed_answer` names
            if path in document["paths"]:
                _add_component(components, chunk)
        _null_means_default(components)
        _drop_fastapi_validation_errors(document)
        _limit_text_lists(components, service.settings.max_inputs_per_request)
        names = service.model_names()
        # `dimensions` is an embedding's width: a tensor model has none, a generate model's
        # output width is its vocabulary.
        widths = sorted(
            width
            for name in names
            if service.model_task(name) == "embed"
            and (width := service.output_width(name)) is not None
        )
        if all(service.model_info(name) is not None for name in names):  # every model loaded
            if widths:
                _narrow_dimensions(components, sorted(set(widths)))
            app.openapi_schema = document  # complete: nothing left to learn at run time
        return document

    app.openapi = openapi  # type: ignore[method-assign]
