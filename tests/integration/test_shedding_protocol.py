"""Refusals written by the HTTP protocol itself (`app/api/shedding_protocol.py`), through a real
uvicorn protocol on a loopback socket, in front of the app with an in-process engine and the
gated fake model (the point is admission, not the numbers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
from starlette.types import Receive, Scope, Send
from uvicorn.server import ServerState

from app.cli import uvicorn_config
from tests.support.scheduling import Harness, start

ONE_MIB = 1 << 20
HELD_PATH = "/test-held"  # answered by the listener itself once the test releases it
PROXIED = "x-forwarded-for: 10.0.0.7\r\nx-envoy-attempt-count: 1\r\n"


@dataclass
class Listener:
    port: int
    state: ServerState  # the server's connections
    app_calls: int = 0  # requests that reached the ASGI app
    held_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    release_held: asyncio.Event = field(default_factory=asyncio.Event)

    def connections_reading(self) -> list[bool]:
        return [connection.transport.is_reading() for connection in self.state.connections]


@contextlib.asynccontextmanager
async def listening(harness: Harness) -> AsyncIterator[Listener]:
    """The harness's app on 127.0.0.1 with the HTTP protocol a front end runs
    (`cli.uvicorn_config`), counting the requests that reach the ASGI app."""
    app = harness.client._transport.app  # type: ignore[attr-defined]
    state = ServerState()
    listener = Listener(port=0, state=state)

    async def counting_app(scope: Scope, receive: Receive, send: Send) -> None:
        listener.app_calls += 1
        if scope["type"] == "http" and scope["path"] == HELD_PATH:
            listener.held_arrived.set()
            await listener.release_held.wait()
            headers = [(b"content-length", b"4")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"held"})
            return
        await app(scope, receive, send)

    config = uvicorn_config(app, harness.service.settings)
    config.app, config.lifespan, config.log_level = counting_app, "off", "warning"
    config.load()
    protocol = config.http_protocol_class
    server = await asyncio.get_running_loop().create_server(
        lambda: protocol(config=config, server_state=state, app_state={}), "127.0.0.1", 0
    )
    listener.port = server.sockets[0].getsockname()[1]
    try:
        yield listener
    finally:
        server.close()
        for connection in list(state.connections):
            connection.shutdown()
        await server.wait_closed()


def post(body: bytes, declared_length: int | None = None, extra_headers: str = "") -> bytes:
    length = len(body) if declared_length is None else declared_length
    head = (
        f"POST /infer HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"{extra_headers}content-length: {length}\r\n\r\n"
    )
    return head.encode() + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode().rstrip("\r\n").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, body


def front_end_sees_the_overload(harness: Harness) -> Callable[[], bool]:
    """Whether the engine status the front end sheds by shows a backlog over the delay
    budget (as `overload` makes it)."""
    budget_s = harness.service.settings.max_queue_delay_ms / 1000

    def sees() -> bool:
        status = harness.service.engine_status()
        return status is not None and status.backlog_s > budget_s

    return sees


async def overload(harness: Harness) -> asyncio.Task[httpx.Response]:
    """Let the engine believe a batch takes ten seconds, then hold the worker in one: a
    request sent now waits that long behind it, far beyond the delay budget, for as long
    as any test here runs. Returns the held request (the caller releases it)."""
    scheduler = harness.engine.hosts["fake"].batcher.scheduler
    for shape in scheduler.policy.shapes():
        for _ in range(30):  # the moving average reaches ~10 s
            scheduler.record_compute(shape, 10.0)
    holder = await harness.hold_the_worker()
    # What the front end sheds by is the engine's published status: wait for the one that
    # shows the running batch, or a request sent now would be let in on the one before.
    await harness.until(front_end_sees_the_overload(harness), "the backlog published")
    return holder


async def test_the_protocol_refuses_from_the_headers_without_the_body() -> None:
    async with start(
        max_queue_delay_ms=50, max_body_bytes=ONE_MIB, refused_read_pause_s=0.0
    ) as harness:
        holder = await overload(harness)
        async with listening(harness) as listener:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            # Only the headers: the 1 MiB they announce is never sent.
            writer.write(post(b"", declared_length=ONE_MIB - 1))
            status, headers, body = await read_answer(reader)
            writer.close()
        assert listener.app_calls == 0  # answered by the protocol: no task, no middleware
        assert status == 429
        assert int(headers["retry-after"]) >= 1
        assert headers["server-timing"].startswith("shed;dur=")
        assert "connection" not in headers  # the connection stays usable
        assert json.loads(body)["error"]["type"] == "queue"
        metrics = (await harness.client.get("/metrics")).text
        assert 'steadyserve_rejected_total{model="",reason="queue"} 1.0' in metrics
        harness.release()
        assert (await holder).status_code == 200


async def test_a_refused_connection_is_read_again_only_after_the_pause() -> None:
    pause_s = 0.3
    async with start(
        max_queue_delay_ms=50, refused_read_pause_s=pause_s, refusals_at_once_per_admission=0
    ) as harness:
        holder = await overload(harness)
        async with listening(harness) as listener:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            request = post(b'{"inputs": "resent at once"}')
            writer.write(request)
            first, _, _ = await read_answer(reader)
            assert listener.connections_reading() == [False]
            resent_at = time.monotonic()
            writer.write(request)  # what a client that ignores Retry-After does
            second, _, _ = await read_answer(reader)
            waited = time.monotonic() - resent_at
            writer.close()
        assert (first, second) == (429, 429)
        assert waited >= pause_s, waited
        harness.release()
        assert (await holder).status_code == 200


async def test_refusals_earned_by_admissions_are_answered_without_a_pause() -> None:
    async with start(
        max_queue_delay_ms=50, refused_read_pause_s=1.0, refusals_at_once_per_admission=2
    ) as harness:
        async with listening(harness) as listener:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(post(b'{"inputs": "admitted: earns two refusals at once"}'))
            assert (await read_answer(reader))[0] == 200
            holder = await overload(harness)
            statuses, reading = [], []
            for _ in range(3):  # what an open-loop client's next requests meet
                writer.write(post(b'{"inputs": "refused"}'))
                statuses.append((await read_answer(reader))[0])
                reading.append(listener.connections_reading())
            writer.close()
        assert statuses == [429, 429, 429]
        assert reading == [[True], [True], [False]]  # the third was not paid for: paused
        metrics = (await harness.client.get("/metrics")).text
        assert "steadyserve_refusals_paused_total 1.0" in metrics
        harness.release()
        assert (await holder).status_code == 200


async def test_requests_the_protocol_admits_are_counted_in_once() -> None:
    async with start() as harness:
        async with listening(harness) as listener:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            for text in ("one", "two", "three"):
                writer.write(post(json.dumps({"inputs": text}).encode()))
                status, _, body = await read_answer(reader)
                assert status == 200, body
            writer.close()
        assert listener.app_calls == 3
        # Admitted in the protocol, left in the middleware: each request once.
        await harness.until(lambda: harness.service.admission.inflight == 0, "all left")
        metrics = (await harness.client.get("/metrics")).text
        assert "steadyserve_rejected_total{" not in metrics


async def test_a_connection_from_a_proxy_is_never_paused() -> None:
    async with start(
        max_queue_delay_ms=50, refused_read_pause_s=1.0, trusted_proxies=["127.0.0.1"]
    ) as harness:
        holder = await overload(harness)
        async with listening(harness) as listener:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            # What the shipped Envoy adds (use_remote_address: true).
            request = post(b'{"inputs": "one of many clients"}', extra_headers=PROXIED)
            writer.write(request)
            first, _, _ = await read_answer(reader)
            # The refusal was written by the callback that would have paused the connection.
            assert listener.connections_reading() == [True]
            writer.write(request)  # the next client's request on the proxy's connection
            second, _, _ = await read_answer(reader)
            writer.close()
        assert (first, second) == (429, 429)
        harness.release()
        assert (await holder).status_code == 200


async def test_a_refusal_leaves_no_idle_timer_on_the_request_read_after_it() -> None:
    """A refusal completes its response inside the parser's callback, which arms uvicorn's
    keep-alive timer (it closes an idle connection); a request pipelined behind it in the
    same read is not idle, and the timer would close its connection mid-answer."""
    async with start(max_queue_delay_ms=50, refused_read_pause_s=0.0) as harness:
        holder = await overload(harness)
        async with listening(harness) as listener:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            held = f"GET {HELD_PATH} HTTP/1.1\r\nhost: test\r\n\r\n".encode()
            writer.write(post(b'{"inputs": "refused"}') + held)  # one read
            assert (await read_answer(reader))[0] == 429
            await listener.held_arrived.wait()
            [connection] = listener.state.connections
            assert connection.timeout_keep_alive_task is None  # type: ignore[attr-defined]
            listener.release_held.set()
            assert (await read_answer(reader))[::2] == (200, b"held")
            writer.close()
        harness.release()
        assert (await holder).status_code == 200


async def closed_by_the_server(reader: asyncio.StreamReader, within_s: float) -> None:
    """Until the server closes the connection (EOF), failing past `within_s`."""
    async with asyncio.timeout(within_s):
        assert await reader.read() == b""


async def test_a_refused_body_trickling_in_is_cut_off_after_the_body_read_timeout() -> None:
    """A refusal from the headers discards the body; the read that brings a byte of it
    cancels the keep-alive timer the answer armed, and no ASGI cycle (nor the body guard's
    timeout) exists: a client sending one byte of its declared body at a time held the
    connection forever (enough of them fill STEADY_MAX_CONNECTIONS)."""
    async with start(
        max_queue_delay_ms=50,
        refused_read_pause_s=0.0,
        body_read_timeout_s=0.3,
        keep_alive_timeout_s=60,  # not what closes it
    ) as harness:
        holder = await overload(harness)
        async with listening(harness) as listener:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(post(b"", declared_length=1_000_000))
            assert (await read_answer(reader))[0] == 429
            writer.write(b"{")  # one byte of the million it declared
            await closed_by_the_server(reader, within_s=5)
            writer.close()
        harness.release()
        assert (await holder).status_code == 200


async def test_a_body_the_app_did_not_read_trickling_in_is_cut_off_too() -> None:
    """The same for an answer the ASGI app wrote before the body (a v2 request shed by its
    route): uvicorn discards the rest of the body with no timeout of its own."""
    async with start(
        max_queue_delay_ms=50,
        refused_read_pause_s=0.0,
        body_read_timeout_s=0.3,
        keep_alive_timeout_s=60,
    ) as harness:
        holder = await overload(harness)
        async with listening(harness) as listener:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(
                b"POST /v2/models/fake/infer HTTP/1.1\r\nhost: test\r\n"
                b"content-type: application/json\r\ncontent-length: 1000000\r\n\r\n"
            )
            assert (await read_answer(reader))[0] == 429
            writer.write(b"{")
            await closed_by_the_server(reader, within_s=5)
            writer.close()
        harness.release()
        assert (await holder).status_code == 200


async def test_a_connection_whose_refused_body_was_discarded_still_times_out_idle() -> None:
    """Once the refused body has all arrived (in reads after the answer), the connection is
    an idle keep-alive one again, closed after the keep-alive timeout."""
    async with start(
        max_queue_delay_ms=50,
        refused_read_pause_s=0.0,
        body_read_timeout_s=60,  # not what closes it
        keep_alive_timeout_s=1,
    ) as harness:
        holder = await overload(harness)
        async with listening(harness) as listener:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            body = b'{"inputs": "sent after its refusal"}'
            writer.write(post(b"", declared_length=len(body)))
            assert (await read_answer(reader))[0] == 429
            writer.write(body)
            await closed_by_the_server(reader, within_s=5)
            writer.close()
        harness.release()
        assert (await holder).status_code == 200


async def answer_after_sending_the_body(
    port: int, head: bytes, body_bytes: int
) -> tuple[int, dict[str, str], bytes]:
    """What a client that sends its whole body before reading (most do) hears: `head`
    declares `body_bytes`, sent in 1 MiB writes, the first with the headers (more than the
    server reads at once: some of it is still unread when the answer is written)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        chunk = b"x" * ONE_MIB
        writer.write(head + chunk)
        await writer.drain()
        for _ in range(body_bytes // ONE_MIB - 1):
            writer.write(chunk)
            await writer.drain()
        answer = await read_answer(reader)
        await closed_by_the_server(reader, within_s=5)
        return answer
    finally:
        writer.close()


async def test_a_refusal_that_closes_its_connection_reaches_a_client_still_sending() -> None:
    """Closing a socket with unread input makes Linux answer with a reset (RST): a client
    still sending the body of a request refused while draining got ECONNRESET, not the
    503. The refusal half-closes instead, discards the body, then closes."""
    async with start(refused_read_pause_s=0.0) as harness:
        harness.service.drain.begin()
        async with listening(harness) as listener:
            head = post(b"", declared_length=16 * ONE_MIB)
            status, headers, body = await answer_after_sending_the_body(
                listener.port, head, 16 * ONE_MIB
            )
        assert status == 503 and headers["connection"] == "close"
        assert json.loads(body)["error"]["type"] == "draining"


async def test_an_answer_the_app_writes_before_a_body_it_refuses_reaches_the_client() -> None:
    """The same for an answer the app writes with `Connection: close` before the body (a
    body declared over the limit: 413 from its headers)."""
    async with start(max_body_bytes=ONE_MIB) as harness:
        async with listening(harness) as listener:
            head = post(b"", declared_length=16 * ONE_MIB)
            status, headers, body = await answer_after_sending_the_body(
                listener.port, head, 16 * ONE_MIB
            )
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(body)["error"]["type"] == "body_too_large"


async def test_a_v2_request_waiting_for_100_continue_is_refused_and_its_connection_closed() -> None:
    """The v2 route sheds from the headers too: to a client waiting for 100 Continue, which
    then never sends the body it declared, the connection was left open, and the next
    request on it was read as that body (never answered)."""
    async with start(max_queue_delay_ms=50, refused_read_pause_s=0.0) as harness:
        holder = await overload(harness)
        async with listening(harness) as listener:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(
                b"POST /v2/models/fake/infer HTTP/1.1\r\nhost: test\r\n"
                b"content-type: application/json\r\ncontent-length: 1000\r\n"
                b"expect: 100-continue\r\n\r\n"
            )
            status, headers, _ = await read_answer(reader)
            assert (status, headers.get("connection")) == (429, "close")
            await closed_by_the_server(reader, within_s=5)
            writer.close()
        harness.release()
        assert (await holder).status_code == 200
