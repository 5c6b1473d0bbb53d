"""`api/common.py::json_body` reads a body exactly as FastAPI reads a required `Body()`
parameter (the reference is FastAPI itself, with the project's error handlers), since
`/infer` parses its own body to be served without FastAPI's routing (`api/direct.py`)."""

from __future__ import annotations

from typing import Annotated, Any

import httpx
from fastapi import Body, FastAPI, Request

from app.api.common import json_body
from app.api.errors import install_error_handlers
from tests.support.infer_bodies import REQUESTS


def echo_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/fastapi")
    async def through_fastapi(body: Annotated[Any, Body()]) -> dict[str, str]:
        return {"type": type(body).__name__, "value": repr(body)}

    @app.post("/ours")
    async def through_json_body(request: Request) -> dict[str, str]:
        body = await json_body(request)
        return {"type": type(body).__name__, "value": repr(body)}

    return app


async def test_json_body_reads_every_body_as_fastapi_does() -> None:
    transport = httpx.ASGITransport(app=echo_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for content_type, body in [*REQUESTS, (None, b'{"inputs": "no content type"}')]:
            headers = {"content-type": content_type} if content_type else {}
            answers = [
                await client.post(path, content=body, headers=headers)
                for path in ("/fastapi", "/ours")
            ]
            fastapi, ours = ((a.status_code, a.json()) for a in answers)
            assert ours == fastapi, (content_type, body[:40])
