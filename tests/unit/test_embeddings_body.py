"""`api/embed.py::embeddings_request` answers every /v1/embeddings body exactly as FastAPI
did for a parameter typed `EmbeddingsRequest` (the reference is FastAPI itself, with the
project's error handlers), since the route reads its own body to be served without FastAPI's
routing (`api/direct.py`)."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI, Request

from app.api.embed import embeddings_request
from app.api.errors import install_error_handlers
from app.schemas import EmbeddingsRequest
from tests.support.infer_bodies import EMBEDDINGS_REQUESTS


def echo_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/fastapi")
    async def through_fastapi(body: EmbeddingsRequest) -> dict[str, Any]:
        return body.model_dump()

    @app.post("/ours")
    async def through_embeddings_request(request: Request) -> dict[str, Any]:
        return (await embeddings_request(request)).model_dump()

    return app


async def test_embeddings_request_reads_every_body_as_fastapi_does() -> None:
    transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=echo_app()))
    sent = [*EMBEDDINGS_REQUESTS, (None, b'{"input": "no content type"}')]
    async with transport as client:
        statuses = set()
        for content_type, body in sent:
            headers = {"content-type": content_type} if content_type else {}
            answers = [
                await client.post(f"http://test{path}", content=body, headers=headers)
                for path in ("/fastapi", "/ours")
            ]
            fastapi, ours = ((a.status_code, a.json()) for a in answers)
            assert ours == fastapi, (content_type, body[:40])
            statuses.add(fastapi[0])
    assert {200, 400, 422} <= statuses, statuses  # the list covers success and mistakes
