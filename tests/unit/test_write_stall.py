"""A client that keeps its connection open but stops reading its answer is cut off
(`app/api/write_stall.py`, in the HTTP protocol a front end runs, `shedding_protocol`): a
stream it stopped reading ends (its producer is closed, as a disconnect closes it), a large
answer left in the buffer of a connection closed after it (keep-alive timeout,
`Connection: close`) is dropped with its connection, each counted; a reader that reads
slowly but steadily keeps its connection, one that half-closed after its request too. Real
sockets on 127.0.0.1, the limit made short; each test waits for the server's events, at
most `WAIT_S` (a failure, not a timing bound)."""

from __future__ import annotations

import asyncio
import contextlib
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
) -> AsyncIterator[tuple[int, asyncio.Event]]:
    """A front end's HTTP protocol in front of `app` on 127.0.0.1: its port, and an event
    set once the server has lost the (one) connection. `high_water`: its transport's
    buffer limit (so an answer stays buffered without pausing the writes); `send_buffer`:
    its socket's (the kernel's share of an answer)."""
    lost = asyncio.Event()
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

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            lost.set()

    config = uvicorn.Config(app, lifespan="off", log_level="warning")
    config.timeout_keep_alive = keep_alive_s  # type: ignore[assignment]  # seconds, as a float
    config.load()
    state = ServerState()
    server = await asyncio.get_running_loop().create_server(
        lambda: Watched(config=config, server_state=state, app_state={}), "127.0.0.1", 0
    )
    try:
        yield server.sockets[0].getsockname()[1], lost
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
    async with serving(app, service) as (port, lost), not_reading(port, get()):
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
    async with serves as (port, lost), not_reading(port, request):
        await asyncio.wait_for(lost.wait(), WAIT_S)
    assert service.stalls() == 1


async def test_a_slow_but_steady_reader_gets_its_whole_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Closed with most of it buffered (little in the kernel's socket buffers), it takes the
    # reader (at most 16 KiB each 10 ms) several limits to read, each read well within one.
    monkeypatch.setattr(HeaderLimitedProtocol, "write_stall_s", 0.3, raising=False)
    service = Service()
    size = 1 << 20
    loop = asyncio.get_running_loop()
    answers = serving(large_answer(size), service, high_water=2 * size, send_buffer=32768)
    async with (
        answers as (port, _),
        not_reading(port, get("connection: close\r\n"), receive_buffer=16384) as client,
    ):
        received = bytearray()
        while chunk := await asyncio.wait_for(loop.sock_recv(client, 16384), WAIT_S):
            received += chunk
            await asyncio.sleep(0.01)
    assert received.startswith(b"HTTP/1.1 200")
    assert received.endswith(b"x" * 1000)
    assert len(received) - received.index(b"\r\n\r\n") - 4 == size
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
    is its progress. Under both loops a front end may run (uvicorn's "auto": uvloop)."""
    monkeypatch.setattr(HeaderLimitedProtocol, "write_stall_s", STALL_S, raising=False)
    closing, looked = StallLimitedTransport.closing, StallLimitedTransport._looked

    async def run() -> None:
        eof, several_looks = asyncio.Event(), asyncio.Event()
        looks = 0

        def closes(self: StallLimitedTransport) -> None:
            closing(self)
            eof.set()

        def looks_on(self: StallLimitedTransport) -> None:
            nonlocal looks
            looked(self)
            looks += 1
            if looks == 5:
                several_looks.set()

        monkeypatch.setattr(StallLimitedTransport, "closing", closes)
        monkeypatch.setattr(StallLimitedTransport, "_looked", looks_on)
        taken: asyncio.Queue[int] = asyncio.Queue()

        async def frames() -> AsyncGenerator[bytes, None]:
            yield b"data: " + b"x" * (1 << 20) + b"\n\n"  # buffered: the client reads none yet
            while True:
                yield b"x" * 2 * await taken.get()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await EventStreamResponse(frames())(scope, receive, send)

        service = Service()
        loop = asyncio.get_running_loop()
        # The writes never pause: only the close watches the transport.
        serves = serving(app, service, high_water=1 << 30, send_buffer=32768)
        async with serves as (port, lost), not_reading(port, get(), 16384) as client:
            assert await asyncio.wait_for(loop.sock_recv(client, 16384), WAIT_S)
            client.shutdown(socket.SHUT_WR)
            await asyncio.wait_for(eof.wait(), WAIT_S)  # the server saw the end of input
            with contextlib.suppress(ConnectionError):
                while not several_looks.is_set():
                    chunk = await asyncio.wait_for(loop.sock_recv(client, 16384), WAIT_S)
                    if not chunk:
                        break  # cut off
                    taken.put_nowait(len(chunk))
                    await asyncio.sleep(0.005)  # a slow reader: ~3 MB/s
            assert several_looks.is_set()
            assert not lost.is_set()
            assert service.stalls() == 0

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run())


class Buffered:
    """A transport whose write buffer holds what the test says (and no socket)."""

    def __init__(self) -> None:
        self.left = 100
        self.closing = self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.left

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.aborted = self.closing = True

    def write(self, data: bytes) -> None:
        self.left += len(data)

    pause_reading = resume_reading = close


async def test_each_look_that_finds_progress_waits_one_limit_more() -> None:
    transport = Buffered()
    stalled = asyncio.Event()
    loop = asyncio.get_running_loop()
    stall = StallLimitedTransport(transport, loop, 0.01, stalled.set)  # type: ignore[arg-type]
    stall.writing_paused()  # 100 bytes buffered
    found: list[int] = []  # what each look found: taken twice, then nothing more

    def looked() -> int:
        found.append(60 if not found else 20)
        return found[-1]

    transport.get_write_buffer_size = looked  # type: ignore[method-assign]
    await asyncio.wait_for(stalled.wait(), WAIT_S)
    assert transport.aborted
    assert found[:3] == [60, 20, 20]  # two looks found progress; the third found none


async def test_what_the_client_took_is_its_progress_however_the_app_tops_the_buffer_up() -> None:
    """Paused, the buffer swings between the low and high water marks as the app refills
    it: a reader that takes some each limit may show as much buffered at a look as at the
    last, or more."""
    transport = Buffered()
    stalled = asyncio.Event()
    loop = asyncio.get_running_loop()
    stall = StallLimitedTransport(transport, loop, 0.01, stalled.set)  # type: ignore[arg-type]
    stall.writing_paused()  # 100 bytes buffered
    found: list[int] = []  # what each look found buffered

    def looked() -> int:
        if len(found) < 2:  # since the last look: the client took 50, the app wrote 60
            transport.left -= 50
            stall.write(b"x" * 60)
        found.append(transport.left)
        return transport.left

    transport.get_write_buffer_size = looked  # type: ignore[method-assign]
    await asyncio.wait_for(stalled.wait(), WAIT_S)
    assert transport.aborted
    assert found[:3] == [110, 120, 120]  # two looks found progress; the third found none


def test_the_send_queue_holds_what_the_client_has_yet_to_take() -> None:
    """A slow reader's progress shows in the socket's send queue long before the buffer
    behind it drains (it refills the queue only once the queue has emptied by half)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server_side, _ = listener.accept()
        with client, server_side:
            server_side.setblocking(False)
            sent = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    sent += server_side.send(b"x" * 65536)
            transport = type("WithSocket", (), {"get_extra_info": lambda self, name: server_side})()
            assert 0 < send_queue(transport) <= sent
            client.settimeout(WAIT_S)
            taken = 0
            while taken < sent:
                taken += len(client.recv(1 << 20))
            deadline = time.monotonic() + WAIT_S  # the last acknowledgements arriving
            while send_queue(transport) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert send_queue(transport) == 0
    assert send_queue(Buffered()) == 0  # no socket
