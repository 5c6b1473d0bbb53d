"""Past uvicorn's connection cap (`limit_concurrency`, set from STEADY_MAX_CONNECTIONS) a
request is refused as the HTTP protocol refuses the others (`app/api/shedding_protocol.py`): the
prebuilt JSON 429 `connections`, with `Retry-After` and the header the shipped Envoy retries
on, counted in `steadyserve_rejected_total`, its connection closed; not uvicorn's own
plain-text 503, which no metric counted; all but Prometheus's scrape, served there. The
protocol is driven with bytes through a fake transport on a real event loop (uvicorn
answers in tasks): no socket, no server."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import pytest
import uvicorn
from uvicorn.server import ServerState

from app.api.errors import RETRY_ELSEWHERE_HEADER
from app.api.refusal_budget import RefusalBudget
from app.api.shedding_protocol import shedding_protocol
from app.metrics import Metrics
from tests.support.fake_transport import FakeTransport
from tests.support.http_responses import Response, responses

CAP = 2
BODY = b'{"inputs": "x"}'
POST_INFER = (
    b"POST /infer HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n" % len(BODY) + BODY
)
GET_METRICS = b"GET /metrics HTTP/1.1\r\nhost: test\r\n\r\n"
GET_HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: test\r\n\r\n"
# A proxy's absolute form with no path: parsed, its path is None (read as "/").
GET_ABSOLUTE_FORM = b"GET http://test HTTP/1.1\r\nhost: test\r\n\r\n"


class Arrivals:
    def __init__(self) -> None:
        self.count = 0

    def arrived(self) -> None:
        self.count += 1


class CappedService:
    """What the protocol asks of a `Service`; admission is never reached at the cap."""

    def __init__(self) -> None:
        self.admission = type("Admission", (), {"draining": False})()
        self.metrics = Metrics()
        self.drain = Arrivals()

    def shed(self, envoy_timeout_ms: float | None, task: str | None = None) -> Any:
        raise AssertionError("a request past the connection cap is never admitted")

    def refused_at_the_cap(self) -> float:
        value = self.metrics.registry.get_sample_value(
            "steadyserve_rejected_total", {"model": "", "reason": "connections"}
        )
        return value or 0.0


async def _app(scope: Any, receive: Any, send: Any) -> None:
    """Answers 200 to any request it is handed."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def connect(
    service: CappedService, state: ServerState, loop: asyncio.AbstractEventLoop
) -> tuple[Any, FakeTransport]:
    """A new connection to a front end whose connection cap is CAP."""
    protocol_class = shedding_protocol(
        service,  # type: ignore[arg-type]
        {"/infer": None},
        read_pause_s=1.0,
        budget=RefusalBudget(0),
        body_read_timeout_s=5.0,
    )
    config = uvicorn.Config(_app, lifespan="off", log_level="warning", limit_concurrency=CAP)
    protocol = protocol_class(  # type: ignore[call-arg]
        config=config, server_state=state, app_state={}, _loop=loop
    )
    transport = FakeTransport(("203.0.113.9", 40000))
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport


async def until_answered(state: ServerState) -> None:
    """Until every task uvicorn started (and those they started) has ended."""
    while state.tasks:
        await asyncio.gather(*list(state.tasks))


def assert_connection_cap_refusal(response: Response) -> None:
    status, headers, body = response
    assert status == 429, (status, body)  # capacity, as the in-flight cap answers
    assert headers["content-type"] == "application/json"
    assert headers["retry-after"] == "1"
    assert headers[RETRY_ELSEWHERE_HEADER] == "1"  # no work done: another replica may take it
    assert headers["connection"] == "close"  # closing the connection frees a place
    error = orjson.loads(body)["error"]
    assert error["type"] == error["code"] == "connections"
    assert error["message"].startswith("over capacity")


@pytest.mark.parametrize(
    "request_bytes",
    [POST_INFER, GET_HEALTHZ, GET_ABSOLUTE_FORM],
    ids=["infer", "healthz", "absolute-form"],
)
def test_a_request_past_the_connection_cap_gets_the_prebuilt_429_and_is_counted(
    request_bytes: bytes,
) -> None:
    service = CappedService()
    state = ServerState()

    async def flood() -> tuple[FakeTransport, int]:
        loop = asyncio.get_running_loop()
        connect(service, state, loop)  # a connection already held
        protocol, transport = connect(service, state, loop)  # the cap's: 2 of 2
        protocol.data_received(request_bytes)
        tasks_started = len(state.tasks)
        await until_answered(state)
        return transport, tasks_started

    transport, tasks_started = asyncio.run(flood())
    [response] = responses(transport.written)
    assert_connection_cap_refusal(response)
    assert "server-timing" in response[1]
    assert transport.closing
    assert tasks_started == 0  # answered from its headers: no task, no ASGI app
    assert service.refused_at_the_cap() == 1
    assert service.drain.count == 1  # an arrival, as the drain's quiet period counts them


def test_a_request_pipelined_past_the_cap_gets_the_same_429_after_the_one_ahead() -> None:
    """uvicorn itself decides on a pipelined request (the protocol leaves those to it so that
    answers keep their order): its 503 is replaced by the same refusal."""
    service = CappedService()
    state = ServerState()

    async def pipelined() -> FakeTransport:
        loop = asyncio.get_running_loop()
        protocol, transport = connect(service, state, loop)
        protocol.data_received(b"GET /first HTTP/1.1\r\nhost: test\r\n\r\n")  # under the cap
        connect(service, state, loop)  # another client fills the cap meanwhile
        protocol.data_received(POST_INFER)  # behind the unanswered first request
        await until_answered(state)
        return transport

    transport = asyncio.run(pipelined())
    first, second = responses(transport.written)
    assert first[0] == 200 and first[2] == b"ok"
    assert_connection_cap_refusal(second)
    assert transport.closing
    assert service.refused_at_the_cap() == 1


def test_a_scrape_past_the_connection_cap_is_served_and_not_counted() -> None:
    """Prometheus's `GET /metrics` was refused 429 `connections` (and counted) at the cap:
    the flood that filled it went unrecorded, scrapes failing just while it lasted. Served,
    from its headers and pipelined behind another request alike; a POST to /metrics is
    refused still."""
    service = CappedService()
    state = ServerState()

    async def scraped() -> tuple[FakeTransport, FakeTransport, FakeTransport]:
        loop = asyncio.get_running_loop()
        connect(service, state, loop)
        protocol, at_the_cap = connect(service, state, loop)  # 2 of 2
        protocol.data_received(GET_METRICS)
        await until_answered(state)
        pipelined_state = ServerState()
        first, pipelined = connect(service, pipelined_state, loop)
        first.data_received(b"GET /first HTTP/1.1\r\nhost: test\r\n\r\n")  # under the cap
        connect(service, pipelined_state, loop)  # the cap is reached meanwhile
        first.data_received(GET_METRICS)  # left to uvicorn: behind the unanswered first
        await until_answered(pipelined_state)
        posting, posted = connect(service, state, loop)
        posting.data_received(post(b"/metrics"))
        await until_answered(state)
        return at_the_cap, pipelined, posted

    at_the_cap, pipelined, posted = asyncio.run(scraped())
    assert [(status, body) for status, _, body in responses(at_the_cap.written)] == [(200, b"ok")]
    assert not at_the_cap.closing  # Prometheus keeps its connection
    assert [(status, body) for status, _, body in responses(pipelined.written)] == [
        (200, b"ok"),
        (200, b"ok"),
    ]
    [refused] = responses(posted.written)
    assert_connection_cap_refusal(refused)
    assert service.refused_at_the_cap() == 1  # the POST alone


def post(path: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (path, len(BODY)) + BODY
    )


@pytest.mark.parametrize(
    ("path", "error_of"),
    [
        (b"/v1/embeddings", lambda body: (body["error"]["type"], body["error"]["code"])),
        (b"/v2/models/m/infer", lambda body: body["error"].split(":")[0]),
    ],
    ids=["openai", "v2"],
)
def test_a_refusal_before_the_body_is_in_its_protocol_s_envelope(
    path: bytes, error_of: Any
) -> None:
    """The OpenAI routes answer every error with OpenAI's `type` and the reason in `code`,
    the Open Inference Protocol's with `{"error": message}` (`responses.in_envelope_of`); a
    refusal written from the headers was the one exception, in the server's own envelope,
    which their clients do not read. Both ways of answering: from the headers, and in
    uvicorn's place for a pipelined request."""
    service = CappedService()
    state = ServerState()

    async def refused() -> tuple[FakeTransport, FakeTransport]:
        loop = asyncio.get_running_loop()
        connect(service, state, loop)
        protocol, at_the_cap = connect(service, state, loop)
        protocol.data_received(post(path))
        await until_answered(state)
        at_the_cap_state = ServerState()
        first, pipelined = connect(service, at_the_cap_state, loop)
        first.data_received(b"GET /first HTTP/1.1\r\nhost: test\r\n\r\n")
        connect(service, at_the_cap_state, loop)
        first.data_received(post(path))
        await until_answered(at_the_cap_state)
        return at_the_cap, pipelined

    at_the_cap, pipelined = asyncio.run(refused())
    expected = {
        "openai": ("rate_limit_exceeded", "connections"),
        "v2": "over capacity",
    }["v2" if path.startswith(b"/v2/") else "openai"]
    for response in (responses(at_the_cap.written)[0], responses(pipelined.written)[1]):
        status, headers, body = response
        assert status == 429 and headers["retry-after"] == "1"
        assert error_of(orjson.loads(body)) == expected


def test_a_websocket_upgrade_pipelined_behind_a_gentle_close_is_dropped_with_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request refused with `Connection: close` while its body is still arriving is closed
    gently: what follows it is read and dropped. A WebSocket upgrade pipelined behind it
    was handed to uvicorn's upgrade, which read the scope of a request never parsed
    (KeyError: 'method'), so the loop force-closed the connection, dropping the answer;
    dropped, it is not logged as an unsupported upgrade either (any client could repeat
    that line)."""
    service = CappedService()
    state = ServerState()
    head, body = POST_INFER.split(b"\r\n\r\n", 1)
    upgrade = (
        b"GET /ws HTTP/1.1\r\nhost: test\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
        b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )

    async def refused_then_upgrade() -> FakeTransport:
        loop = asyncio.get_running_loop()
        connect(service, state, loop)
        protocol, transport = connect(service, state, loop)  # the cap's
        protocol.ws_protocol_class = object  # a WebSocket library installed (uvicorn's "auto")
        # uvicorn's loggers do not propagate, and its Config (made by `connect`) resets them.
        protocol.logger.addHandler(caplog.handler)
        protocol.data_received(head + b"\r\n\r\n" + body[:4])  # refused, closing gently
        protocol.data_received(body[4:] + upgrade)
        await until_answered(state)
        return transport

    try:
        transport = asyncio.run(refused_then_upgrade())
    finally:
        logging.getLogger("uvicorn.error").removeHandler(caplog.handler)
    [response] = responses(transport.written)
    assert_connection_cap_refusal(response)
    assert transport.eof_written and transport.closing
    assert "upgrade" not in caplog.text.lower()
