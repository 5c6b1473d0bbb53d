"""`POST /infer` and `POST /v1/embeddings` served by `api/direct.py` answer exactly as the
FastAPI routes they bypass,
for well-formed requests and for every kind of client mistake (the in-process engine and the
gated fake model: the point is the HTTP contract, not the numbers)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.direct import DirectRoute
from tests.support.infer_bodies import EMBEDDINGS_REQUESTS, REQUESTS
from tests.support.scheduling import start

BODIES = {"/infer": REQUESTS, "/v1/embeddings": EMBEDDINGS_REQUESTS}


def without_direct_route(app: FastAPI) -> None:
    app.user_middleware = [m for m in app.user_middleware if m.cls is not DirectRoute]


class RouterCalls:
    """Innermost middleware: the paths of the requests that went on to FastAPI's router."""

    def __init__(self, app: ASGIApp, paths: list[str]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


async def answers(path: str, prepare: Any = None) -> list[tuple[int, str | None, Any]]:
    async with start(prepare=prepare) as harness:
        results = []
        for content_type, body in BODIES[path]:
            response = await harness.client.post(
                path, content=body, headers={"content-type": content_type}
            )
            results.append(
                (response.status_code, response.headers.get("content-type"), response.json())
            )
        metrics = (await harness.client.get("/metrics")).text
        counted = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("http_requests_total{") and f'handler="{path}"' in line
        )
        assert counted == len(BODIES[path]), f"every {path} request counted in the HTTP metrics"
        return results


@pytest.mark.parametrize("path", list(BODIES))
async def test_the_direct_route_answers_as_the_fastapi_route(path: str) -> None:
    direct = await answers(path)
    through_fastapi = await answers(path, prepare=without_direct_route)
    for sent, ours, theirs in zip(BODIES[path], direct, through_fastapi, strict=True):
        assert ours == theirs, sent
    statuses = {status for status, _, _ in direct}
    refused_field = 400 if path.startswith("/v1/") else 422  # OpenAI's status on /v1
    # The list covers success and mistakes.
    assert {200, 400, 413, refused_field} <= statuses, direct


async def test_the_direct_routes_skip_the_fastapi_router_and_other_routes_do_not() -> None:
    routed: list[str] = []

    def count_router_calls(app: FastAPI) -> None:
        app.user_middleware.append(Middleware(RouterCalls, paths=routed))  # innermost

    async with start(prepare=count_router_calls) as harness:
        assert (await harness.client.post("/infer", json={"inputs": "x"})).status_code == 200
        sent = await harness.client.post("/v1/embeddings", json={"input": "x"})
        assert sent.status_code == 200
        assert (await harness.client.get("/v1/models")).status_code == 200
        # Another method on a direct path goes on to FastAPI (which refuses it).
        assert (await harness.client.get("/v1/embeddings")).status_code == 405
    assert routed == ["/v1/models", "/v1/embeddings"]
    routed.clear()
    async with start(
        prepare=lambda app: (without_direct_route(app), count_router_calls(app))
    ) as harness:
        assert (await harness.client.post("/infer", json={"inputs": "x"})).status_code == 200
        sent = await harness.client.post("/v1/embeddings", json={"input": "x"})
        assert sent.status_code == 200
    assert routed == ["/infer", "/v1/embeddings"]
