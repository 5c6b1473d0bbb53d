"""The OpenAI generation routes read their body as /infer and /v1/embeddings do
(`api/common.py::body_as`): UTF-8 only, a leading BOM ignored, anything else a 400 of the
same shape; and, in UTF-8, every body is answered as FastAPI answered a parameter typed
`CompletionRequest` / `ChatCompletionRequest` (the reference is FastAPI itself)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from app.api import embed, generate
from app.api.common import body_as
from app.api.errors import install_error_handlers
from app.schemas_generation import ChatCompletionRequest, CompletionRequest

JSON_ROUTES = ("/infer", "/v1/embeddings", "/v1/completions", "/v1/chat/completions")
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}


def routes_app() -> FastAPI:
    """The JSON inference routes alone: a body they cannot decode is refused before they
    ask anything of a service (none is set)."""
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(embed.router)
    app.include_router(generate.router)
    return app


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
async def test_a_body_not_in_utf8_is_refused_alike_by_every_json_route(encoding: str) -> None:
    body = json.dumps(COMPLETION | {"inputs": "Hello", "input": "Hello"}).encode(encoding)
    transport = httpx.ASGITransport(app=routes_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        answers = {
            path: await client.post(
                path, content=body, headers={"content-type": "application/json"}
            )
            for path in JSON_ROUTES
        }
    infer = answers["/infer"]
    # Undecodable (http_error), or, without a BOM, NULs that are valid UTF-8 but no JSON.
    assert infer.status_code == 400
    assert infer.json()["error"]["type"] in ("http_error", "invalid_json")
    for path, answer in answers.items():
        # On the OpenAI routes with OpenAI's type; the reason in `code`, as everywhere.
        openai = {"type": "invalid_request_error"} if path.startswith("/v1/") else {}
        expected = {"error": {**infer.json()["error"], **openai}}
        assert (answer.status_code, answer.json()) == (400, expected), path


def reference_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/fastapi/completions")
    async def fastapi_completions(body: CompletionRequest) -> dict[str, Any]:
        return body.model_dump()

    @app.post("/fastapi/chat")
    async def fastapi_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        return body.model_dump()

    @app.post("/ours/completions")
    async def our_completions(request: Request) -> dict[str, Any]:
        return (await body_as(request, CompletionRequest)).model_dump()

    @app.post("/ours/chat")
    async def our_chat(request: Request) -> dict[str, Any]:
        return (await body_as(request, ChatCompletionRequest)).model_dump()

    return app


BODIES: list[tuple[str | None, bytes]] = [
    ("application/json", json.dumps(COMPLETION).encode()),
    ("application/json", json.dumps(CHAT).encode()),
    ("application/json", b"\xef\xbb\xbf" + json.dumps(COMPLETION).encode()),  # a BOM
    ("application/json; charset=utf-8", json.dumps(CHAT).encode()),
    ("application/json", b""),
    ("application/json", b"{not json"),
    ("application/json", b"[1, 2]"),
    ("application/json", b'"a string"'),
    ("application/json", json.dumps({**COMPLETION, "max_tokens": "many"}).encode()),
    ("application/json", json.dumps({**CHAT, "messages": "hi"}).encode()),
    ("text/plain", json.dumps(COMPLETION).encode()),
    (None, json.dumps(CHAT).encode()),
]


async def test_generation_bodies_in_utf8_are_read_as_fastapi_read_them() -> None:
    transport = httpx.ASGITransport(app=reference_app())
    statuses = set()
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for route in ("completions", "chat"):
            for content_type, body in BODIES:
                headers = {"content-type": content_type} if content_type else {}
                fastapi, ours = [
                    await client.post(f"/{side}/{route}", content=body, headers=headers)
                    for side in ("fastapi", "ours")
                ]
                assert (ours.status_code, ours.json()) == (
                    fastapi.status_code,
                    fastapi.json(),
                ), (route, content_type, body[:40])
                statuses.add(fastapi.status_code)
    assert {200, 400, 422} <= statuses, statuses
