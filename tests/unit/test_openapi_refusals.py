"""The refusals' headers and the connection cap's 429, as the OpenAPI document the app
publishes states them, against the answers the server writes: `Retry-After`, the header
the shipped Envoy retries on and `Connection: close` are response headers of the 429s and
503s, and every operation the connection cap refuses (all but Prometheus's scrape)
documents its 429."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI
from uvicorn.server import ServerState

from app.admission import RejectReason
from app.api.errors import REJECTION_STATUS, RETRY_ELSEWHERE_HEADER
from app.api.shedding import envelope_of, raw_refusal
from app.main import create_app
from app.settings import Settings
from loadtest.null_engine import NullEngine
from tests.support.http_responses import responses
from tests.unit.test_connection_cap import CappedService, connect, until_answered

# What a refusal says beyond its body: the headers the document must name.
REFUSAL_HEADERS = {"retry-after", RETRY_ELSEWHERE_HEADER, "connection"}


def published_document() -> dict[str, Any]:
    settings = Settings(spike_reports=False)
    app: FastAPI = create_app(settings, engine=NullEngine(settings))
    return app.openapi()


def operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method.upper(), path, operation)
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
    ]


def documented_headers(operation: dict[str, Any], status: int) -> set[str]:
    answer = operation["responses"][str(status)]
    return {name.lower() for name in answer.get("headers", {})}


def answer_past_the_cap(method: str, path: str) -> tuple[int, dict[str, str]]:
    """What a front end at its connection cap answers the request (the protocol's own
    refusal, or the app's answer where it serves one: a fake 200)."""
    service = CappedService()
    state = ServerState()
    target = path.replace("{model}", "minilm").encode()
    request = method.encode() + b" " + target + b" HTTP/1.1\r\nhost: test\r\n"
    request += b"content-length: 2\r\n\r\n{}" if method == "POST" else b"\r\n"

    async def at_the_cap() -> bytes:
        loop = asyncio.get_running_loop()
        connect(service, state, loop)  # a connection already held
        protocol, transport = connect(service, state, loop)  # the cap's: 2 of 2
        protocol.data_received(request)
        await until_answered(state)
        return bytes(transport.written)

    [(status, headers, _)] = responses(asyncio.run(at_the_cap()))
    return status, headers


def test_every_operation_the_connection_cap_refuses_documents_its_429_and_headers() -> None:
    """GET /v1/models, /v1/models/{model}, /healthz and /readyz were refused 429
    `connections` undocumented; /metrics is served past the cap."""
    served = []
    for method, path, operation in operations(published_document()):
        status, headers = answer_past_the_cap(method, path)
        if status == 200:
            served.append(path)
            assert "429" not in operation["responses"], path
            continue
        assert status == 429, (path, status)
        assert "429" in operation["responses"], path
        assert "`connections`" in operation["responses"]["429"]["description"], path
        sent = REFUSAL_HEADERS & set(headers)
        assert sent == REFUSAL_HEADERS  # not vacuous: the cap's refusal carries all three
        assert sent <= documented_headers(operation, 429), path
    assert served == ["/metrics"]


@pytest.mark.parametrize("close", [False, True], ids=["kept-alive", "closed"])
@pytest.mark.parametrize(
    "reason", [r for r in RejectReason if REJECTION_STATUS[r] in (429, 503)], ids=str
)
def test_the_headers_of_a_refusal_are_documented_for_each_route_that_answers_it(
    reason: RejectReason, close: bool
) -> None:
    """The prebuilt refusal (`shedding.raw_refusal`, built from `errors.refusal_headers` as
    the app's own answers are) of each route the admission refuses, its headers named in
    its status's entry: they were only in the description's text."""
    inference = [
        (path, operation)
        for method, path, operation in operations(published_document())
        if method == "POST"
    ]
    assert {path for path, _ in inference} >= {"/infer", "/v1/embeddings"}
    for path, operation in inference:
        head, body = raw_refusal(reason.value, "1", close, envelope_of(path))
        [(status, headers, _)] = responses(head + b"\r\n" + body)
        sent = REFUSAL_HEADERS & set(headers)
        assert sent <= documented_headers(operation, status), (path, reason, sent)
