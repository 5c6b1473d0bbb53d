"""The generation routes as OpenAI's own client and the OpenAPI document see them, with the
tiny model's real tokenizer in front of a scripted engine that echoes each prompt's tokens
(tests/support/scripted_generator.py), so the expected text is known exactly."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from app.engine.protocol import GeneratePayload
from tests.support.generation_frontend import PROMPT, engine_of

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_the_openai_client_parses_every_answer_unchanged(app: FastAPI) -> None:
    import openai

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
        models = await client.models.list()
        assert {m.id for m in models.data} == {"tiny", "plain", "minilm"}
        completion = await client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, temperature=0
        )
        tokenizer = app.state.service.tokenizers["tiny"]
        expected = tokenizer.decode(tokenizer.encode(PROMPT)[1:5])
        assert completion.choices[0].text == expected and PROMPT.startswith(expected)
        assert completion.choices[0].finish_reason == "length"
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello world"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces = [chunk async for chunk in stream]
        assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 5
        assert pieces[-2].choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="plain", messages=[{"role": "user", "content": "hi"}]
            )


async def test_what_the_openai_client_sends_for_parameters_passed_as_none_is_served(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    """The client sends null for a parameter its caller passed as None, and OpenAI reads it
    as the default; each was a 422. A negative seed is within OpenAI's range, and
    `include_obfuscation: false` asks for nothing this server adds."""
    import openai

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
        openai_client = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="none", http_client=http
        )
        nulls = {
            "temperature": None,
            "top_p": None,
            "n": None,
            "presence_penalty": None,
            "frequency_penalty": None,
        }
        chat = await openai_client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=3,
            stream=None,
            seed=-5,
            **nulls,
        )
        assert chat.choices[0].finish_reason in ("length", "stop")
        completion = await openai_client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=3,
            echo=None,
            **nulls,
        )
        assert completion.usage is not None and completion.usage.completion_tokens >= 1
        stream = await openai_client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
        )
        assert [chunk async for chunk in stream][-1].usage is not None
    sent = engine_of(app).submitted[-3].payload
    assert isinstance(sent, GeneratePayload) and sent.sampling.seed == -5


async def test_the_openapi_document_states_generation_for_the_generate_models(
    client: httpx.AsyncClient,
) -> None:
    document = (await client.get("/openapi.json")).json()
    assert {"/v1/completions", "/v1/chat/completions", "/infer"} <= set(document["paths"])
    infer_body = document["paths"]["/infer"]["post"]["requestBody"]["content"]
    variants = infer_body["application/json"]["schema"]["anyOf"]
    assert {v["$ref"].rsplit("/", 1)[1] for v in variants} == {
        "InferRequest",
        "GenerateInferRequest",
    }
    schemas = document["components"]["schemas"]
    for name, models in [
        ("CompletionRequest", ["tiny", "plain"]),
        ("GenerateInferRequest", ["tiny", "plain"]),
        ("ChatCompletionRequest", ["tiny"]),  # "plain" has no chat template
    ]:
        model = schemas[name]["properties"]["model"]  # the default model generates: optional
        assert model["anyOf"] == [{"type": "string", "enum": [*models, ""]}, {"type": "null"}]
    # The embedding requests name the embedding model: the default model generates.
    for name in ("InferRequest", "EmbeddingsRequest"):
        assert schemas[name]["properties"]["model"]["enum"] == ["minilm"]
        assert "model" in schemas[name]["required"]
    assert schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["maxItems"] == 64
    # `dimensions` names the embedding model's width only, not a vocabulary size.
    dimensions = schemas["EmbeddingsRequest"]["properties"]["dimensions"]["anyOf"][0]
    assert dimensions["enum"] == [384]
