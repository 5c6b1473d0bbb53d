"""The OpenAPI document at /openapi.json, made to state what this server enforces.

FastAPI's document comes from the pydantic models alone; limits that come from settings or
from the loaded model are added here, so that a request valid by the document is one the
server accepts (schemathesis checks this in tests/e2e/test_openapi_e2e.py):

- the list forms of `inputs` / `input` get `maxItems` = `STEADY_MAX_INPUTS_PER_REQUEST`;
- `dimensions` of /v1/embeddings is narrowed to the served models' output widths once they
  are loaded (until then the document is rebuilt on each request and not cached).

What JSON Schema cannot state (an input's token count, the deadline) is answered with the
documented 413 and 504 responses. Called on the event loop thread (the /openapi.json route).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.service import Service

# (component, field) of every request field that takes one text or a list of texts.
_TEXT_LIST_FIELDS = (("InferRequest", "inputs"), ("EmbeddingsRequest", "input"))


def _limit_text_lists(components: dict[str, Any], max_items: int) -> None:
    for component, field in _TEXT_LIST_FIELDS:
        for variant in components[component]["properties"][field]["anyOf"]:
            if variant.get("type") == "array":
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
        components = document["components"]["schemas"]
        _limit_text_lists(components, service.settings.max_inputs_per_request)
        widths = [service.output_width(name) for name in service.model_names()]
        known = sorted({width for width in widths if width is not None})
        if len(known) == len(set(widths)):  # every model loaded
            _narrow_dimensions(components, known)
            app.openapi_schema = document  # complete: nothing left to learn at run time
        return document

    app.openapi = openapi  # type: ignore[method-assign]
