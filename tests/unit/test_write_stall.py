"""A client that keeps its connection open but stops reading its answer is cut off
(`app/api/write_stall.py`, in the HTTP protocol a front end runs, `shedding_protocol`): a
stream it stopped reading ends (its producer is closed, as a disconnect closes it), a large
answer left in the buffer of a connection closed after it (keep-alive timeout,
`Connection: close`) is dropped with its connection, each counted; a reader that reads
slowly but steadily keeps its connection, one that half-closed after its request too. Real
sockets on 127.0.0.1, the limit made short; each test waits for the server's events, at
most `WAIT_S` (a failure, not a timing bound). Where the client reads, the limit's looks
run on a clock the test moves (`ManualTimers`), each only once the server has seen the
client take more since the last: on the loop's clock a stall of the process just after a
look could make the next one due before the client's next read (a task woken from a sleep
runs a loop pass after the timers that fell due with it), and it would find nothing taken:
a spurious abort."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import pytest
import uvicorn
import uvloop
from uvicorn.server import ServerState

from app.api.header_limits import HeaderLimitedProtocol
from app.api.refusal_budget import RefusalBudget
from app.api.shedding_protocol import shedding_protocol
from app.api.sse import EventStreamResponse
from app.api.write_stall import StallLimitedTransport, send_queue
from app.metrics import Metrics
from tests.support.manual_timers import ManualTimers

WAIT_S = 10.0
STALL_S = 0.2  # the write-stall limit, made short
LARGE = 16 << 20  # more than the kernel's socket buffers hold: most of it stays buffered


class Service:
    """What the protocol asks of a `Service` when no path is shed and no cap is set, and
    where it counts a stall."""

    admission = type("Admission", (), {"draining": False})()
    drain = type("Drain", (), {"arrived": lambda self: None})()

    def __init__(self) -> None:
        self.metrics = Metrics()

    def stalls(self) -> float:
        value = self.metrics.registry.get_sample_value("steadyserve_write_stalls_total")
        return value or 0.0


@contextlib.asynccontextmanager
async def serving(
    app: Any,
    service: Service,
    *,
    keep_alive_s: float = 30.0,
    high_water: int | None = None,
    send_buffer: int | None = None,
    timers: ManualTimers | None = None,
) -> AsyncIterator[tuple[int, asyncio.Event, list[StallLimitedTransport]]]:
    """A front end's HTTP protocol in front of `app` on 127.0.0.1: its port, an event set
    once the server has lost the (one) connection, and its connections' stall limits.
    `high_water`: its transport's buffer limit (so an answer stays buffered without pausing
    the writes); `send_buffer`: its socket's (the kernel's share of an answer); `timers`:
    its timers (the stall limit's looks) on that clock, else on the event loop's."""
    lost = asyncio.Event()
    stalls: list[StallLimitedTransport] = []
    base = shedding_protocol(
        service,  # type: ignore[arg-type]
        {},
        read_pause_s=1.0,
        budget=RefusalBudget(0),
        body_read_timeout_s=5.0,
    )

    class Watched(base):  # type: ignore[valid-type,misc]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if high_water is not None:
                transport.set_write_buffer_limits(high=high_water)
            if send_buffer is not None:
                sock = transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
            super().connection_made(transport)
            stalls.append(self._stall)

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            lost.set()

    config = uvicorn.Config(app, lifespan="off", log_level="warning")
    config.timeout_keep_alive = keep_alive_s  # type: ignore[assignment]  # seconds, as a float
    config.load()
    state = ServerState()
    server = await asyncio.get_running_loop().create_server(
        lambda: Watched(config=config, server_state=state, app_state={}, _loop=timers),
        "127.0.0.1",
        0,
    )
    try:
        yield server.sockets[0].getsockname()[1], lost, stalls
    finally:
        server.close()
        for connection in list(state.connections):
            connection.transport.abort()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def not_reading(
    port: int, request: bytes, receive_buffer: int = 4096
) -> AsyncIterator[socket.socket]:
    """A client with a small receive buffer that sends `request` and reads nothing (unless
    the test reads)."""
    loop = asyncio.get_running_loop()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    client.setblocking(False)
    try:
        await loop.sock_connect(client, ("127.0.0.1", port))
        await loop.sock_sendall(client, request)
        yield client
    finally:
        client.close()


def took(stall: StallLimitedTransport) -> int:
    """What the client has taken of all the server wrote, measured by the test as a look
    measures it: all written, less what is buffered and in the socket's send queue."""
    transport = stall._transport
    return stall._written - transport.get_write_buffer_size() - send_queue(transport)


def readable(client: socket.socket) -> bool:
    return bool(select.select([client], [], [], 0)[0])


async def until(condition: Callable[[], bool]) -> None:
    """Wait (on the loop) until `condition` holds, within `WAIT_S` (a failure, not a timing
    bound): what the kernel does with the client's reads has no event to wait on."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "not within WAIT_S"
        await asyncio.sleep(0.001)


async def read_on(
    client: socket.socket,
    stall: StallLimitedTransport,
    lost: asyncio.Event,
    timers: ManualTimers,
    looks: int | None = None,
    each_read: Callable[[int], None] = lambda size: None,
) -> tuple[bytes, int]:
    """Read what the server sends, 16 KiB a read (`each_read` told its size); each time the
    server has seen the client take more since the last look (its reads acknowledged), move
    the clock one limit on: the look that falls due finds that. Until the end of the
    answer (or the connection is cut off), or `looks` looks: what was read, the looks run.
    Called with the look armed: what the client took then is no more than now."""
    loop = asyncio.get_running_loop()
    received, since, ran = bytearray(), took(stall), 0
    while looks is None or ran < looks:
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(client, 16384), WAIT_S)
        except ConnectionError:
            chunk = b""
        if not chunk:
            break
        received += chunk
        each_read(len(chunk))
        # Lost first: the closed socket is no longer the server's to measure.
        await until(lambda since=since: lost.is_set() or took(stall) > since or readable(client))
        if not lost.is_set() and took(stall) > since:
            assert timers.advance(STALL_S) == ["_looked"]  # found progress: armed again
            ran += 1
            since = took(stall)
    return bytes(received), ran


def get(headers: str = "") -> bytes:
    return f"GET /answer HTTP/1.1\r\nhost: test\r\n{headers}\r\n".encode()


def large_answer(size: int) -> Callable[..., Any]:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-length", b"%d" % size)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"x" * size})

    return app


async def test_a_stream_whose_client_stopped_reading_is_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(HeaderLimitedProtocol, "write_stall_s", STALL_S, raising=False)
    producer_closed = asyncio.Event()

    async def frames() -> AsyncGenerator[bytes, None]:
        try:
            while True:  # a stream with no end of its own: only its client's can end it
                yield b"data: " + b"x" * 65536 + b"\n\n"
        finally:
            producer_closed.set()  # in the app: its engine requests cancelled

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await EventStreamResponse(frames())(scope, receive, send)

    service = Service()
    async with serving(app, service) as (port, lost, _), not_reading(port, get()):
        await asyncio.wait_for(producer_closed.wait(), WAIT_S)
        await asyncio.wait_for(lost.wait(), WAIT_S)
    assert service.stalls() == 1


@pytest.mark.parametrize("closed_by", ["keep-alive timeout", "Connection: close"])
async def test_an_answer_left_unread_at_close_is_dropped_with_its_connection(
    monkeypatch: pytest.MonkeyPatch, closed_by: str
) -> None:
    monkeypatch.setattr(HeaderLimitedProtocol, "write_stall_s", STALL_S, raising=False)
    service = Service()
    # Buffered without pausing the writes: only the close leaves it there.
    serves = serving(large_answer(LARGE), service, keep_alive_s=0.05, high_water=2 * LARGE)
    request = get("connection: close\r\n" if closed_by == "Connection: close" else "")
    async with serves as (port, lost, _), not_reading(port, request):
        await asyncio.wait_for(lost.wait(), WAIT_S)
    assert service.stalls() == 1


async def test_a_slow_but_steady_reader_gets_its_whole_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Closed with most of it buffered (little in the kernel's socket buffers), it takes the
    # reader (at most 16 KiB a read) several limits to read, some taken in each.
    monkeypatch.setattr(HeaderLimitedProtocol, "write_stall_s", STALL_S, raising=False)
    service = Service()
    size = 1 << 20
    timers = ManualTimers(asyncio.get_running_loop())
    answers = serving(
        large_answer(size), service, high_water=2 * size, send_buffer=32768, timers=timers
    )
    async with (
        answers as (port, lost, stalls),
        not_reading(port, get("connection: close\r\n"), receive_buffer=16384) as client,
    ):
        await timers.until_armed("_looked")  # all written, the close waits for the client
        [stall] = stalls
        received, looks = await read_on(client, stall, lost, timers)
    assert received.startswith(b"HTTP/1.1 200")
    assert received.endswith(b"x" * 1000)
    assert len(received) - received.index(b"\r\n\r\n") - 4 == size
    assert looks >= 3  # the kernel's buffers hold a tenth of it
    assert service.stalls() == 0


@pytest.mark.parametrize(
    "loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_half_closed_client_that_reads_on_keeps_its_stream(
    monkeypatch: pytest.MonkeyPatch, loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    """A client that ends its input after the request (a half-close: the transport closes
    once its buffer is empty) but reads on while the stream goes on: the app keeps writing
    to the closing transport, so what the client has yet to take does not fall (here it
    grows: the app writes twice what the client reads); what it took since the last look
    is its progress. Once it stops reading, it is cut off. Under both loops a front end may
    run (uvicorn's "auto": uvloop)."""
    monkeypatch.setattr(HeaderLimitedProtocol, "write_stall_s", STALL_S, raising=False)
    closing = StallLimitedTransport.closing

    async def run() -> None:
        eof = asyncio.Event()

        def closes(self: StallLimitedTransport) -> None:
            closing(self)
            eof.set()

        monkeypatch.setattr(StallLimitedTransport, "closing", closes)
        taken: asyncio.Queue[int] = asyncio.Queue()

        async def frames() -> AsyncGenerator[bytes, None]:
            yield b"data: " + b"x" * (1 << 20) + b"\n\n"  # buffered: the client reads none yet
            while True:
                yield b"x" * 2 * await taken.get()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await EventStreamResponse(frames())(scope, receive, send)

        service = Service()
        loop = asyncio.get_running_loop()
        timers = ManualTimers(loop)
        # The writes never pause: only the close watches the transport.
        serves = serving(app, service, high_water=1 << 30, send_buffer=32768, timers=timers)
        async with serves as (port, lost, stalls), not_reading(port, get(), 16384) as client:
            assert await asyncio.wait_for(loop.sock_recv(client, 16384), WAIT_S)
            client.shutdown(socket.SHUT_WR)
            await asyncio.wait_for(eof.wait(), WAIT_S)  # the server saw the end of input
            await timers.until_armed("_looked")  # and watches its close
            [stall] = stalls
            _, looks = await read_on(client, stall, lost, timers, 5, taken.put_nowait)
            assert looks == 5  # each found progress
            assert not lost.is_set()
            assert service.stalls() == 0
            # It reads no more: a look finds nothing more taken (after any the kernel had
            # yet to deliver into its receive buffer) and cuts it off.
            for _ in range(100):
                assert timers.advance(STALL_S) == ["_looked"]
                if service.stalls():
                    break
            await asyncio.wait_for(lost.wait(), WAIT_S)
            assert service.stalls() == 1

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run())
