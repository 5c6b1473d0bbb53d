"""The limits on what arrives before a request's headers end (`app/api/header_limits.py`, in
the HTTP protocol a front end runs, `shedding_protocol`): a connection that sends nothing is
closed after the keep-alive timeout, one whose headers do not end within the header timeout
of their first byte is answered 408 and closed, one whose request line and headers pass
the cap is answered 431 and closed, and a client within the limits notices nothing. Real
sockets on 127.0.0.1, short timeouts: each test waits for the server to close the socket."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import uvicorn
from uvicorn.server import ServerState

from app.api.header_limits import MAX_HEADER_BYTES
from app.api.refusal_budget import RefusalBudget
from app.api.shedding_protocol import shedding_protocol
from app.metrics import Metrics
from tests.support.fake_transport import FakeTransport
from tests.support.http_responses import Response, responses
from tests.support.manual_timers import ManualTimers, Timer
from tests.support.server import REPO_ROOT

HELD = "/held"  # answered once the test sets `release`
WAIT_S = 10.0  # the most any test waits for the server: a failure, not a bound on timing


class Arrivals:
    def __init__(self) -> None:
        self.count = 0

    def arrived(self) -> None:
        self.count += 1


class Admits:
    """What the protocol asks of a `Service` when no path is shed and no cap is set, and
    where it counts a refusal of its own."""

    admission = type("Admission", (), {"draining": False})()

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.drain = Arrivals()

    def refused(self, reason: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "steadyserve_rejected_total", {"model": "", "reason": reason}
        )
        return value or 0.0


@contextlib.asynccontextmanager
async def serving(
    header_timeout_s: float = 30.0,
    keep_alive_s: float = 30.0,
    timers: ManualTimers | None = None,
) -> AsyncIterator[tuple[int, asyncio.Event]]:
    """A front end's HTTP protocol on 127.0.0.1 (its port), in front of an app that answers
    200 with the length of the body it read (`HELD` once the event is set); its timers on
    `timers`' clock where given, else on the event loop's."""
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        length, more = 0, True
        while more:
            message = await receive()
            length += len(message.get("body", b""))
            more = message.get("more_body", False)
        if scope["path"] == HELD:
            await release.wait()
        body = orjson.dumps({"read": length})
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    protocol = shedding_protocol(
        Admits(),  # type: ignore[arg-type]
        {},
        read_pause_s=1.0,
        budget=RefusalBudget(0),
        body_read_timeout_s=5.0,
        header_timeout_s=header_timeout_s,
    )
    config = uvicorn.Config(app, lifespan="off", log_level="warning")
    config.timeout_keep_alive = keep_alive_s  # type: ignore[assignment]  # seconds, as a float
    config.load()
    state = ServerState()
    server = await asyncio.get_running_loop().create_server(
        lambda: protocol(config=config, server_state=state, app_state={}, _loop=timers),  # type: ignore[call-arg]
        "127.0.0.1",
        0,
    )
    try:
        yield server.sockets[0].getsockname()[1], release
    finally:
        release.set()
        server.close()
        for connection in list(state.connections):
            connection.transport.close()
        await server.wait_closed()


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (within WAIT_S)."""
    return await asyncio.wait_for(reader.read(), WAIT_S)


async def dribble(writer: asyncio.StreamWriter, data: bytes, every_s: float) -> int:
    """Send `data` a byte at a time until the server closes the connection; bytes sent."""
    for sent in range(len(data)):
        if writer.transport.is_closing():
            return sent
        writer.write(data[sent : sent + 1])
        try:
            await writer.drain()
        except ConnectionError:
            return sent
        await asyncio.sleep(every_s)
    return len(data)


def assert_refused(response: Response, status: int, error_type: str) -> None:
    code, headers, body = response
    assert code == status, (code, body)
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    error = orjson.loads(body)["error"]
    assert error["code"] == error_type if isinstance(error, dict) else error  # v2's: a string


async def test_a_connection_that_sends_nothing_is_closed_after_the_keep_alive_timeout() -> None:
    async with serving(keep_alive_s=0.3) as (port, _):
        started = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await until_closed(reader) == b""  # closed, unanswered: no request began
        assert time.monotonic() - started >= 0.25
        writer.close()


async def test_a_request_whose_headers_stop_is_answered_408_and_closed() -> None:
    async with serving(header_timeout_s=0.3) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        writer.write(b"POST /v1/embeddings HTTP/1.1\r\nhost: test\r\nx-slow: ")
        [response] = responses(await until_closed(reader))
        assert time.monotonic() - started >= 0.25
        assert_refused(response, 408, "header_timeout")
        # In the envelope of the path as far as it arrived: OpenAI's here.
        assert orjson.loads(response[2])["error"]["type"] == "invalid_request_error"
        writer.close()


async def test_headers_dribbled_a_byte_at_a_time_are_cut_at_the_deadline() -> None:
    """Each byte comes long before the header timeout: the deadline runs from the first."""
    request = b"POST /infer HTTP/1.1\r\nhost: test\r\nx-pad: " + b"a" * 400 + b"\r\n\r\n"
    async with serving(header_timeout_s=0.5) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        sender = asyncio.create_task(dribble(writer, request, every_s=0.02))
        [response] = responses(await until_closed(reader))
        elapsed = time.monotonic() - started
        writer.close()
        sent = await sender
    assert_refused(response, 408, "header_timeout")
    assert elapsed >= 0.45 and sent < len(request)


async def test_blank_lines_dribbled_on_an_idle_connection_do_not_hold_it() -> None:
    """Blank lines before a request begin none (the parser skips them), but each cancelled
    the idle timer: a client sending one now and then held its connection forever."""
    async with serving(header_timeout_s=0.3, keep_alive_s=30.0) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sender = asyncio.create_task(dribble(writer, b"\r\n" * 1000, every_s=0.02))
        assert await until_closed(reader) == b""  # no request to answer
        writer.close()
        assert await sender < 2000


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /healthz HTTP/1.1\r\nx-big: " + b"a" * (1 << 20) + b"\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nx-big: " + b"a" * (1 << 20),  # and no line end
        b"GET /" + b"a" * (1 << 20),  # a URL that never ends
        b"GET /healthz HTTP/1.1\r\n"
        + b"".join(b"x-header-%05d: %s\r\n" % (i, b"v" * 60) for i in range(2000))
        + b"\r\n",  # many headers, 150 KiB
    ],
    ids=["a-mebibyte-header", "a-header-without-end", "a-url-without-end", "many-headers"],
)
async def test_headers_over_the_cap_are_answered_431_and_closed(request_bytes: bytes) -> None:
    async with serving() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_bytes)  # all of it is read, then dropped: no reset
        [response] = responses(await until_closed(reader))
        writer.close()
    assert_refused(response, 431, "headers_too_large")


async def test_headers_just_within_the_cap_are_served() -> None:
    """What Envoy forwards (its default limit, 60 KiB, plus what it adds) is never refused."""
    padding = b"a" * (MAX_HEADER_BYTES - 1024)
    request = b"GET /x HTTP/1.1\r\nhost: test\r\nx-pad: " + padding + b"\r\n\r\n"
    async with serving() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        writer.close()
    assert head.startswith(b"HTTP/1.1 200 ")


async def test_a_keep_alive_client_making_several_requests_is_unaffected() -> None:
    """Idle between requests for longer than the header timeout (the keep-alive timeout
    applies there), headers split over several writes, bodies: every request is served on
    the one connection, which stays open. The protocol's timers run on a clock the test
    moves (real sockets, real reads): idle 5x the header timeout, then the rest of the
    headers 0.95 of it after their first byte; a deadline left running from an earlier
    request, or not restarted at each one's first byte, fires within those moves. On the
    loop's clock a stall of the process (GC, a noisy CI machine) could make the deadline
    and the client's second write due in one loop pass, the deadline first: a spurious
    408."""
    body = b'{"inputs": "x"}'
    head = b"POST /infer HTTP/1.1\r\nhost: test\r\ncontent-length: %d\r\n" % len(body)
    timers = ManualTimers(asyncio.get_running_loop())
    async with serving(header_timeout_s=2.0, keep_alive_s=30.0, timers=timers) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(4):
            assert timers.advance(10.0) == []  # idle past the header timeout: nothing fires
            writer.write(head)
            await writer.drain()
            await timers.until_armed("_header_deadline_passed")  # the server has read it
            assert timers.advance(1.9) == []  # the rest of the headers, within the timeout
            writer.write(b"x-more: 1\r\n\r\n" + body)
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            assert await asyncio.wait_for(reader.readuntil(b"}"), WAIT_S) == b'{"read":15}'
        assert not reader.at_eof()
        writer.close()


async def test_a_request_waiting_behind_an_answer_is_refused_only_after_it() -> None:
    """A pipelined request's headers stall while the request before it is computing: the
    408 waits for that answer, and never overtakes it."""
    async with serving(header_timeout_s=0.2) as (port, release):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET %s HTTP/1.1\r\nhost: test\r\n\r\nGET /next HTTP/1.1\r\nx-" % HELD.encode()
        )
        with pytest.raises(TimeoutError):  # nothing, while the header timeout passes 3 times
            await asyncio.wait_for(reader.read(1), 0.6)
        release.set()
        first, second = responses(await until_closed(reader))
        writer.close()
    assert first[0] == 200
    assert_refused(second, 408, "header_timeout")


async def test_headers_over_the_cap_behind_an_answer_are_refused_only_after_it() -> None:
    """A pipelined request's headers pass the cap while the request before it computes:
    the connection was closed at once, the earlier answer lost (and the unread input
    reset it); the 431 now waits for that answer, as the 408 does."""
    async with serving() as (port, release):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET %s HTTP/1.1\r\nhost: test\r\n\r\nGET /next HTTP/1.1\r\nx-pad: " % HELD.encode()
            + b"a" * (1024 * 1024)  # over several reads: the cap is judged as each ends
        )
        with pytest.raises(TimeoutError):  # refused, but not before the answer ahead of it
            await asyncio.wait_for(reader.read(1), 0.3)
        release.set()
        first, second = responses(await until_closed(reader))
        writer.close()
    assert first[0] == 200
    assert_refused(second, 431, "headers_too_large")


def test_the_readme_names_the_header_refusals() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert "| 408 |" in readme and "`header_timeout`" in readme
    assert "| 431 |" in readme and "`headers_too_large`" in readme


class RecordingLoop:
    """Records the timers the protocol sets; none runs."""

    def __init__(self) -> None:
        self.timers: list[Timer] = []

    def call_later(self, delay: float, callback: Any, *args: Any) -> Timer:
        self.timers.append(Timer(delay, callback))
        return self.timers[-1]


def test_what_follows_headers_over_the_cap_in_the_same_read_is_dropped_unparsed() -> None:
    """Headers over the cap that end within one read are refused as they end; a request
    pipelined after them is not parsed (no answer, no 400), and the linger that closes the
    connection is left running."""
    protocol_class = shedding_protocol(
        Admits(),  # type: ignore[arg-type]
        {},
        read_pause_s=1.0,
        budget=RefusalBudget(0),
        body_read_timeout_s=3.0,  # the linger
        max_header_bytes=1000,
    )
    loop = RecordingLoop()
    config = uvicorn.Config(_never_called, lifespan="off", log_level="warning")
    protocol = protocol_class(  # type: ignore[call-arg]
        config=config, server_state=ServerState(), app_state={}, _loop=loop
    )
    transport = FakeTransport(("203.0.113.9", 40000))
    protocol.connection_made(transport)  # type: ignore[arg-type]
    oversized = b"POST /v2/models/m/infer HTTP/1.1\r\nx-pad: " + b"a" * 2000 + b"\r\n"
    pipelined = b"GET /healthz HTTP/1.1\r\nhost: test\r\n\r\n"
    protocol.data_received(oversized + b"content-length: 2\r\n\r\n{}" + pipelined)
    protocol.data_received(pipelined)  # after the refusal: dropped

    [response] = responses(bytes(transport.written))
    assert_refused(response, 431, "headers_too_large")
    assert orjson.loads(response[2]) == {"error": "request line and headers exceed 1000 bytes"}
    assert transport.eof_written and not transport.closing
    [linger] = [timer for timer in loop.timers if not timer.cancelled]
    assert (linger.delay, linger.callback) == (3.0, protocol.transport.close)  # stall-limited


async def _never_called(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("a refused request never reaches the app")


def test_headers_sent_a_byte_at_a_time_are_refused_after_so_many_reads() -> None:
    """Each read copies the URL or header value so far (uvicorn's `url +=`, httptools'
    values): a byte at a time within the 64 KiB cap made ~2 GiB of copying on the event
    loop per connection. Past `max_header_reads` reads the request is answered 431, and
    counted as the other refusals are."""
    service = Admits()
    protocol_class = shedding_protocol(
        service,  # type: ignore[arg-type]
        {},
        read_pause_s=1.0,
        budget=RefusalBudget(0),
        body_read_timeout_s=3.0,
    )
    config = uvicorn.Config(_never_called, lifespan="off", log_level="warning")
    protocol = protocol_class(  # type: ignore[call-arg]
        config=config, server_state=ServerState(), app_state={}, _loop=RecordingLoop()
    )
    transport = FakeTransport(("203.0.113.9", 40000))
    protocol.connection_made(transport)  # type: ignore[arg-type]
    request = b"GET /x HTTP/1.1\r\nx-slow: " + b"a" * 2000
    reads = protocol_class.max_header_reads + 1
    for index in range(reads):
        protocol.data_received(request[index : index + 1])
    [response] = responses(bytes(transport.written))
    assert_refused(response, 431, "headers_too_large")
    message = orjson.loads(response[2])["error"]["message"]
    assert message == f"request line and headers arrived in over {reads - 1} reads"
    assert service.refused("headers_too_large") == 1 and service.drain.count == 1
