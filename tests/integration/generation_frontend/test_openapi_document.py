"""The OpenAPI document the app publishes (`app/api/openapi.py`) against what its routes
answer, with two generate models (the default, "tiny", and "plain", without a chat
template) and an embedding model served."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from jsonschema import Draft202012Validator

from app.main import create_app
from app.settings import Settings
from tests.support.asgi import serving
from tests.support.generation import sse_payloads
from tests.support.generation_frontend import engine_of
from tests.support.openapi_document import documented_valid
from tests.support.scripted_generator import ScriptedGenerator

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


async def disagreement(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> str | None:
    """None if the route accepts `body` (200) exactly when the document says it is valid
    (what it refuses, it refuses as a request's mistake); else what happened."""
    document = await published(client)
    response = await client.post(path, json=body)
    assert response.status_code in (200, 400, 404, 422), response.text
    valid = documented_valid(document, path, body)
    if valid == (response.status_code == 200):
        return None
    return f"documented {'valid' if valid else 'invalid'}, answered {response.text[:200]}"


COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GENERATE = {"inputs": "hi", "parameters": {"max_new_tokens": 2}}
WHOLE_NUMBERS = [
    ("/v1/completions", {**COMPLETION, "max_tokens": 2.0}),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 0.0, "frequency_penalty": 0.0}),
    ("/v1/completions", {**COMPLETION, "n": 1.0, "best_of": 1.0}),
    ("/v1/completions", {**COMPLETION, "top_k": 2.0, "seed": -3.0}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2.0, "n": 1.0}),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2.0}),
    ("/v1/embeddings", {"model": "minilm", "input": "hi", "dimensions": 384.0}),
    ("/infer", {"inputs": "hi", "parameters": {"max_new_tokens": 2.0, "seed": 1.0}}),
    # Refused, as the document says: a fraction, a boolean, a string.
    ("/v1/completions", {**COMPLETION, "max_tokens": 2.5}),
    ("/v1/completions", {**COMPLETION, "max_tokens": True}),
    ("/v1/completions", {**COMPLETION, "max_tokens": "2"}),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 0.5}),
    ("/v1/completions", {**COMPLETION, "presence_penalty": False}),
    ("/v1/completions", {**COMPLETION, "n": True}),  # was served: `True == 1`
    ("/v1/completions", {**COMPLETION, "best_of": True}),
    ("/v1/completions", {**COMPLETION, "n": 2.5}),
    ("/v1/chat/completions", {**CHAT, "n": True}),
    ("/v1/embeddings", {"model": "minilm", "input": "hi", "dimensions": 384.5}),
    ("/infer", {**GENERATE, "parameters": {"max_new_tokens": True}}),
]


@pytest.mark.parametrize(("path", "body"), WHOLE_NUMBERS)
async def test_a_whole_number_is_an_integer_as_the_document_says(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    """OpenAPI 3.1's integers include 16.0, and OpenAI types the penalties as numbers
    (Python callers send 0.0): `max_tokens: 16.0` was refused, and `n: true` served."""
    assert await disagreement(client, path, body) is None


TOKEN_ID_PROMPTS = [
    [1, 2, 3],
    [[1, 2], [3]],
    [1.0, 2],
    [1] * 65,  # one prompt of more ids than STEADY_MAX_INPUTS_PER_REQUEST (the document said 64)
    # Refused, as the document says.
    [],
    [[]],
    ["hi", 1],
    [[1, 2], "hi"],
    [-1],
    [True],
    [1.5],
]


@pytest.mark.parametrize("prompt", TOKEN_ID_PROMPTS)
async def test_token_id_prompts_are_served_as_the_document_says(
    client: httpx.AsyncClient, prompt: object
) -> None:
    """A completion's `prompt` of token ids (a list of ids, or a list of such lists) was
    refused; served, the document's union of four kinds says which it takes."""
    assert await disagreement(client, "/v1/completions", {**COMPLETION, "prompt": prompt}) is None


NULLABLE_BODIES = [
    ("/v1/embeddings", "EmbeddingsRequest", {"model": "minilm", "input": "hi"}),
    ("/v1/completions", "CompletionRequest", COMPLETION),
    ("/v1/chat/completions", "ChatCompletionRequest", CHAT),
]


@pytest.mark.parametrize(("path", "component", "base"), NULLABLE_BODIES)
async def test_each_field_takes_null_exactly_when_the_document_says_so(
    client: httpx.AsyncClient, path: str, component: str, base: dict[str, Any]
) -> None:
    """OpenAI reads null as the default of `temperature`, `n`, `stream`, the penalties...
    (the openai client sends null for a parameter passed as None): served, but documented
    as not nullable. Every field the document states is sent null in turn."""
    properties = (await published(client))["components"]["schemas"][component]["properties"]
    assert {"model", *base} <= set(properties)  # not vacuous
    disagreements = {
        field: answer
        for field in properties
        if (answer := await disagreement(client, path, {**base, field: None})) is not None
    }
    assert sorted(disagreements) == [], disagreements


MODELS = [
    # An embedding request without a model went to the default, a generate model (422).
    ("/infer", {"inputs": "hi", "parameters": {"normalize": False}}),
    ("/infer", {"inputs": "hi", "model": "tiny", "parameters": {"normalize": False}}),
    ("/infer", {"inputs": "hi", "model": "minilm", "parameters": {"normalize": False}}),
    ("/infer", {"inputs": "hi", "model": "plain", "parameters": {"max_new_tokens": 2}}),
    ("/infer", {"inputs": "hi", "model": "minilm", "parameters": {"max_new_tokens": 2}}),
    ("/v1/embeddings", {"input": "hi"}),
    ("/v1/embeddings", {"input": "hi", "model": "tiny"}),
    ("/v1/embeddings", {"input": "hi", "model": "minilm"}),
    ("/v1/completions", {**COMPLETION, "model": "minilm"}),
    ("/v1/chat/completions", {**CHAT, "model": "plain"}),  # no chat template
    # An empty name is the default model's.
    ("/infer", {**GENERATE, "model": ""}),
    ("/v1/embeddings", {"input": "hi", "model": ""}),
    ("/v1/completions", {**COMPLETION, "model": ""}),
    ("/v1/chat/completions", {**CHAT, "model": ""}),
]


@pytest.mark.parametrize(("path", "body"), MODELS)
async def test_a_model_is_documented_for_the_routes_of_its_task(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    """With a generate model the default, the embedding requests' `model` was any string
    or absent, and bodies valid by the document went to a model of the other task."""
    assert await disagreement(client, path, body) is None


async def test_with_an_embedding_model_the_default_the_generation_routes_need_a_model(
    settings: Settings,
) -> None:
    embedding_first = settings.model_copy(update={"models": settings.models[::-1]})
    app = create_app(embedding_first, engine=ScriptedGenerator(embedding_first))
    async with serving(app) as client:
        for path, body in [
            ("/infer", {"inputs": "hi", "parameters": {"normalize": False}}),
            ("/infer", {"inputs": "hi", "model": "", "parameters": {"normalize": False}}),
            ("/infer", {**GENERATE, "model": ""}),
            ("/infer", {**GENERATE, "model": "tiny"}),
            ("/v1/embeddings", {"input": "hi", "model": ""}),
            ("/v1/embeddings", {"input": "hi", "model": None}),
            ("/v1/completions", COMPLETION),
            ("/v1/completions", {**COMPLETION, "model": ""}),
            ("/v1/completions", {**COMPLETION, "model": "plain"}),
            ("/v1/chat/completions", {**CHAT, "model": None}),
        ]:
            assert await disagreement(client, path, body) is None, (path, body)


def stream_event_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    """The documented schema of each `data:` event of a streamed 200 (`x-events`)."""
    streamed = document["paths"][path]["post"]["responses"]["200"]["content"]
    return {**streamed["text/event-stream"]["x-events"], "components": document["components"]}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {**COMPLETION, "prompt": ["hi", "there"]}),
        ("/v1/chat/completions", CHAT),
    ],
)
async def test_a_stream_is_documented_as_the_events_it_sends(
    client: httpx.AsyncClient, app: FastAPI, path: str, body: dict[str, Any]
) -> None:
    """`stream: true` answers text/event-stream (chunks, the usage chunk, `[DONE]`; an
    error event on a failure after it began), which the document's 200 stated as JSON."""
    document = await published(client)
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    whole = await client.post(path, json=streamed)
    engine = engine_of(app)
    engine.fail_after_tokens = 1
    try:
        failed = await client.post(path, json={**streamed, "max_tokens": 3})
    finally:
        engine.fail_after_tokens = None
    documented = document["paths"][path]["post"]["responses"]["200"]["content"]
    for response in (whole, failed):
        assert response.status_code == 200
        assert response.headers["content-type"].split(";")[0] in documented
    validator = Draft202012Validator(stream_event_schema(document, path))
    for response in (whole, failed):
        for event in sse_payloads(response.content):  # ends with `data: [DONE]`
            validator.validate(event)
    assert "error" in sse_payloads(failed.content)[-1]
    assert sse_payloads(whole.content)[-1]["usage"]["completion_tokens"] > 0


async def test_the_tokenizer_routes_are_served_as_the_document_says(
    client: httpx.AsyncClient,
) -> None:
    """Two generate models and STEADY_DEFAULT_MODEL unset: the tokenizer routes have no
    model to pick, so `model` is required; the chat form names only the model with a chat
    template. The document called `model` optional everywhere (a 400 to a valid request,
    which schemathesis found on an embedding-only server)."""
    messages = CHAT["messages"]
    bodies = [
        ("/tokenize", {"prompt": "hi"}),
        ("/tokenize", {"model": "minilm", "prompt": "hi"}),
        ("/tokenize", {"model": "tiny", "messages": messages}),
        ("/tokenize", {"model": "plain", "messages": messages}),
        ("/tokenize", {"messages": messages}),
        ("/detokenize", {"tokens": [1]}),
        ("/detokenize", {"model": "plain", "tokens": [1]}),
    ]
    found = [(path, body, await disagreement(client, path, body)) for path, body in bodies]
    assert [problem for problem in found if problem[2] is not None] == []
    document = await published(client)
    (parameter,) = document["paths"]["/tokenizer_info"]["get"]["parameters"]
    assert parameter["required"] is True
    assert (await client.get("/tokenizer_info")).status_code == 400
