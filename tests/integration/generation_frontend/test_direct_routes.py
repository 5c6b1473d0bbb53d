"""`POST /v1/completions` and `POST /v1/chat/completions` served by `api/direct.py` answer
exactly as the FastAPI routes they bypass, whole and streamed, for well-formed requests and
for the client mistakes these routes refuse (the scripted engine: the point is the HTTP
contract, not the text)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.middleware import Middleware

from app.main import create_app
from app.settings import Settings
from tests.integration.test_direct_route import RouterCalls, without_direct_route
from tests.support.asgi import serving
from tests.support.generation_frontend import PROMPT
from tests.support.scripted_generator import ScriptedGenerator

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = [{"role": "user", "content": PROMPT}]
BODIES: dict[str, list[bytes]] = {
    "/v1/completions": [
        json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4}).encode(),
        json.dumps({"model": "tiny", "prompt": [PROMPT, "Hi"], "max_tokens": 3}).encode(),
        json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True}).encode(),
        json.dumps({"model": "nope", "prompt": PROMPT}).encode(),  # unknown model: 404
        json.dumps({"model": "minilm", "prompt": PROMPT}).encode(),  # another task: 400
        json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": -1}).encode(),
        json.dumps({"model": "tiny", "prompt": PROMPT, "best_of": 3}).encode(),  # refused field
        b'{"model": "tiny", "prompt": ',  # broken JSON
    ],
    "/v1/chat/completions": [
        json.dumps({"model": "tiny", "messages": CHAT, "max_tokens": 4}).encode(),
        json.dumps({"model": "tiny", "messages": CHAT, "max_tokens": 4, "stream": True}).encode(),
        json.dumps({"model": "plain", "messages": CHAT}).encode(),  # no chat template: 400
        json.dumps({"model": "tiny", "messages": []}).encode(),
        json.dumps({"model": "tiny", "messages": [{"role": "pilot", "content": "x"}]}).encode(),
        b"[]",
    ],
}
# What differs between two answers to one request whatever the route: its id and time.
PER_ANSWER = {"id", "created", "system_fingerprint"}


def _comparable(content_type: str | None, text: str) -> Any:
    """The answer without its per-answer fields; a stream as its list of events."""
    if content_type and content_type.startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in text.split("\n\n") if line]
        return [event if event == "[DONE]" else _comparable(None, event) for event in events]
    loaded = json.loads(text)
    if isinstance(loaded, dict):
        return {key: value for key, value in loaded.items() if key not in PER_ANSWER}
    return loaded


async def _answers(settings: Settings, path: str, prepare: Any = None) -> list[Any]:
    app = create_app(settings, engine=ScriptedGenerator(settings))
    if prepare is not None:
        prepare(app)
    async with serving(app) as client:
        results = []
        for body in BODIES[path]:
            response = await client.post(
                path, content=body, headers={"content-type": "application/json"}
            )
            content_type = response.headers.get("content-type")
            results.append(
                (response.status_code, content_type, _comparable(content_type, response.text))
            )
        return results


@pytest.mark.parametrize("path", list(BODIES))
async def test_the_direct_route_answers_as_the_fastapi_route(settings: Settings, path: str) -> None:
    direct = await _answers(settings, path)
    through_fastapi = await _answers(settings, path, prepare=without_direct_route)
    for sent, ours, theirs in zip(BODIES[path], direct, through_fastapi, strict=True):
        assert ours == theirs, sent
    statuses = {status for status, _, _ in direct}
    assert {200, 400} <= statuses, direct  # the list covers success and mistakes
    assert any(isinstance(answer, list) for _, _, answer in direct), "a stream is compared"


async def test_the_generation_routes_skip_the_fastapi_router(settings: Settings) -> None:
    routed: list[str] = []

    def count_router_calls(app: FastAPI) -> None:
        app.user_middleware.append(Middleware(RouterCalls, paths=routed))  # innermost

    app = create_app(settings, engine=ScriptedGenerator(settings))
    count_router_calls(app)
    async with serving(app) as client:
        sent: httpx.Response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        )
        assert sent.status_code == 200, sent.text
        sent = await client.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 2}
        )
        assert sent.status_code == 200, sent.text
        # Another method on a direct path goes on to FastAPI (which refuses it).
        assert (await client.get("/v1/completions")).status_code == 405
    assert routed == ["/v1/completions"]
