"""The OpenAPI document the app publishes (`app/api/openapi.py`) against what its routes
answer, with two generate models (the default, "tiny", and "plain", without a chat
template) and an embedding model served."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def published(client: httpx.AsyncClient) -> dict[str, Any]:
    document: dict[str, Any] = (await client.get("/openapi.json")).json()
    return document


async def test_the_model_route_documents_only_the_statuses_it_answers(
    client: httpx.AsyncClient,
) -> None:
    """Its `{model}` takes any path, so FastAPI's 422 HTTPValidationError (added for every
    route with a parameter) is never answered: neither it nor its components are stated."""
    document = await published(client)
    names = ["tiny", "minilm", "nope", "a/b", "%20", "0", "tiny/", "x" * 300]
    answered = {(await client.get(f"/v1/models/{name}")).status_code for name in names}
    documented = document["paths"]["/v1/models/{model}"]["get"]["responses"]
    # And the connection cap's 429 (tests/unit/test_openapi_refusals.py).
    assert set(documented) - {"429"} == {str(status) for status in answered} == {"200", "404"}
    assert "HTTPValidationError" not in str(document)
    assert "ValidationError" not in document["components"]["schemas"]
