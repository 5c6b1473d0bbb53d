"""Whether a request body is valid by the OpenAPI document the app publishes: its
operation's request body schema, checked as the JSON Schema (2020-12) OpenAPI 3.1 says it
is (so 16.0 is an integer), its `$ref`s resolved in the document's components."""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator


def documented_valid(document: dict[str, Any], path: str, body: object) -> bool:
    """Whether `body` is a valid JSON body of POST `path` by `document`."""
    content = document["paths"][path]["post"]["requestBody"]["content"]
    schema = {**content["application/json"]["schema"], "components": document["components"]}
    return bool(Draft202012Validator(schema).is_valid(body))
