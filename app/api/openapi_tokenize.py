"""The tokenizer routes' part of the OpenAPI document (`openapi.py` calls it): `model`
narrowed to the served models with a tokenizer (the chat form of /tokenize: to the generate
models with a chat template), and left out, null or "" only where the routes have a model
to serve then (`tokenize.default_tokenizer_model`); the chat form not documented where no
model has a chat template, and no tokenizer route where no model has a tokenizer. So a
request the document calls valid names a model the route can serve (schemathesis checks
this in tests/e2e/test_openapi_e2e.py); /detokenize's ids are held under the smallest
vocabulary served once every tokenizer is loaded (with models of different vocabularies, an
id between two sizes is valid for the larger model's only: the document cannot say which).
Called on the event loop thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.api.tokenize import TOKENIZER_ROUTES, default_tokenizer_model, tokenizer_models
from app.models.tokenizer import FastTokenizer
from app.schemas_tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from app.service import Service

Narrow = Callable[[dict[str, Any], list[str], str], None]


def document_tokenizer_routes(
    document: dict[str, Any], service: Service, chatting: list[str], narrow: Narrow
) -> None:
    """Narrow the tokenizer routes' `model` in `document` with `narrow` (`openapi.py`'s
    rule for a request's `model`: optional only where the default given is among the
    models); `chatting`: the generate models with a chat template."""
    components, paths = document["components"]["schemas"], document["paths"]
    served = tokenizer_models(service)
    default = default_tokenizer_model(service) or ""
    if not served:
        for path in TOKENIZER_ROUTES:
            paths.pop(path, None)
        for body in (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest):
            components.pop(body.__name__, None)
        return
    for body, models in ((TokenizeCompletionRequest, served), (DetokenizeRequest, served)):
        _narrow_keeping_description(components[body.__name__], models, default, narrow)
    sizes = [
        tokenizer.vocabulary_size
        for name in served
        if isinstance(tokenizer := service.tokenizers.get(name), FastTokenizer)
    ]
    if sizes and len(sizes) == len(served):
        ids = components[DetokenizeRequest.__name__]["properties"]["tokens"]["items"]
        ids["maximum"] = min(sizes) - 1
    chat = TokenizeChatRequest.__name__
    if chatting:
        _narrow_keeping_description(components[chat], chatting, default, narrow)
    else:
        components.pop(chat, None)
        body = paths["/tokenize"]["post"]["requestBody"]["content"]["application/json"]
        body["schema"] = {"$ref": f"#/components/schemas/{TokenizeCompletionRequest.__name__}"}
    for parameter in paths["/tokenizer_info"]["get"].get("parameters", []):
        if parameter.get("name") == "model":
            component: dict[str, Any] = {"properties": {"model": parameter["schema"]}}
            _narrow_keeping_description(component, served, default, narrow)
            parameter["schema"] = component["properties"]["model"]
            parameter["required"] = "model" in component.get("required", [])


def _narrow_keeping_description(
    component: dict[str, Any], models: list[str], default: str, narrow: Narrow
) -> None:
    """`narrow`, keeping `model`'s own description (which model these routes pick when it
    is left out), where it has one."""
    description = component["properties"]["model"].get("description")
    narrow(component, models, default)
    if description:
        component["properties"]["model"]["description"] = description
