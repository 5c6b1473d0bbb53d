"""The front end's ZeroMQ engine client when the engine is gone: a request sent then is
refused at once (503), and the dead engine's last statuses, read late, do not bring it back
as ready. Real ZeroMQ sockets on a private IPC directory, no engine process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from app.admission import Rejected, RejectReason
from app.api.errors import RETRY_ELSEWHERE_HEADER, engine_unavailable_headers
from app.engine.client import EngineNotConnected
from app.engine.identity import frontend_identity
from app.engine.protocol import (
    Cancel,
    EmbedOutput,
    EmbedPayload,
    EngineStatus,
    Output,
    Submit,
    decode_to_engine,
    encode_batch,
)
from app.engine.zmq_client import (
    NEW_ENGINE,
    STALE_AFTER_S,
    EngineAddresses,
    StatusSubscriber,
    ZmqEngineClient,
)
from app.main import _engine_client
from app.metrics import Metrics
from app.settings import Settings
from tests.support.engine_status import ready_status
from tests.support.manual_clock import ManualClock


def status(engine_id: str, published_at: float) -> EngineStatus:
    return ready_status(engine_id, published_at)


async def one_request(client: ZmqEngineClient, tokens: int = 1) -> list[Output]:
    """Every output of one embedding request of `tokens` tokens."""
    request = Submit(
        client.next_request_id(), "m", time.monotonic() + 60, EmbedPayload([[1] * tokens])
    )
    return [output async for output in client.stream(request)]


async def test_a_request_sent_while_no_engine_is_connected_is_refused_at_once(
    tmp_path: Path,
) -> None:
    """zmq.asyncio puts the send's zmq.Again on the future it returns: the client took the
    send for done, and the request waited silently for its deadline (a 504 instead of an
    immediate 503)."""
    client = ZmqEngineClient(EngineAddresses.in_directory(tmp_path))
    await client.start()
    try:
        # A status still held (as after a lagging loop), but no engine on the socket.
        client._subscriber.take(status("gone", time.monotonic()))
        assert client.status() is not None
        request = Submit(client.next_request_id(), "m", time.monotonic() + 60, EmbedPayload([[1]]))
        with pytest.raises(EngineNotConnected, match="no engine is connected") as refused:
            async for _ in client.stream(request):
                pass
        assert client.open_streams == 0
        # Nothing reached an engine: a proxy may send it to another replica at once.
        assert engine_unavailable_headers(refused.value)[RETRY_ELSEWHERE_HEADER] == "1"
    finally:
        await client.close()


@pytest.mark.parametrize("injected", [0.0, 1e9], ids=["clock behind", "clock ahead"])
def test_a_forgotten_engines_late_statuses_do_not_bring_it_back(injected: float) -> None:
    """A status's `published_at` is on the protocol's clock (time.monotonic, the engine
    process's), whatever clock the subscriber was given (for staleness): `forget` stamped
    the injected one, so on a clock behind a dead engine's late status brought it back,
    and on one ahead an engine that recovered stayed forgotten."""
    lost: list[str] = []
    clock = ManualClock(injected)
    subscriber = StatusSubscriber(None, "", clock=clock, on_lost=lost.append)  # type: ignore[arg-type]
    before = time.monotonic()
    subscriber.take(status("a", before - 0.1))
    subscriber.forget()  # its connection closed
    # Published before it died, read after: the engine stays forgotten.
    subscriber.take(status("a", before - 0.05))
    assert subscriber.status() is None
    # Published after the forget: it is alive after all (a loop that was late).
    after = time.monotonic() + 0.1
    subscriber.take(status("a", after))
    assert subscriber.status() == status("a", after)
    # A replacement is heard, and reported as a new engine.
    subscriber.take(status("b", after + 0.1))
    assert subscriber.status() == status("b", after + 0.1) and lost == [NEW_ENGINE]


async def test_a_front_ends_identity_names_its_pid_and_the_token_it_was_started_with(
    tmp_path: Path,
) -> None:
    """What the supervisor's `FrontEndGone(pid, token)` is matched against in the engine
    (the token `app.processes` gives each start, through `create_app`): its pid alone also
    named a later front end the kernel gave the same pid."""
    settings = Settings(engine="process")
    addresses = EngineAddresses.in_directory(tmp_path)
    client, _ = _engine_client(settings, Metrics(), addresses, None, spawn_token=0x3A)
    try:
        assert client.origin == frontend_identity(os.getpid(), 0x3A)  # type: ignore[attr-defined]
        assert frontend_identity(4242, 0x3A) == b"fe-4242-3a"
    finally:
        await client.close()


async def connected(client: ZmqEngineClient) -> None:
    """Until the client has heard its socket connect: it connects in ZeroMQ's I/O thread,
    and a send before the monitor says so is refused (as if no engine were there)."""
    for _ in range(1000):  # bounded poll: 10 s
        client._dealer.take_events()
        if client._dealer.connected:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the client never connected to the engine's socket")


async def test_an_unreadable_answer_fails_the_open_requests_and_later_ones_are_answered(
    tmp_path: Path,
) -> None:
    """An answer that did not decode ended the receiving loop: every later answer went
    unread, each request waiting out its deadline while the front end said ready."""
    addresses = EngineAddresses.in_directory(tmp_path)
    context = zmq.asyncio.Context()
    engine = context.socket(zmq.ROUTER)
    engine.bind(addresses.requests)
    client = ZmqEngineClient(addresses)
    await client.start()

    async def answer_next(frame: bytes | None) -> None:
        origin, data = await engine.recv_multipart()
        submit = decode_to_engine(data)
        assert isinstance(submit, Submit)
        vectors = EmbedOutput(b"\0" * 4, rows=1, width=1, input_tokens=1)
        final = Output(submit.request_id, True, vectors, queue_s=0.0, compute_s=0.0)
        await engine.send_multipart([origin, frame if frame is not None else encode_batch([final])])

    try:
        await connected(client)
        client._subscriber.take(status("e", time.monotonic()))
        answering = asyncio.create_task(answer_next(b"\xc1 not msgpack"))
        with pytest.raises(Rejected):  # engine_lost: 503, retry
            await asyncio.wait_for(one_request(client), 10)
        await answering
        # The engine still held it: told to drop it, not left to run to its end.
        _, data = await asyncio.wait_for(engine.recv_multipart(), 10)
        assert isinstance(decode_to_engine(data), Cancel)
        answering = asyncio.create_task(answer_next(None))
        outputs = await asyncio.wait_for(one_request(client), 10)
        await answering
        assert len(outputs) == 1 and outputs[0].final
    finally:
        await client.close()
        context.destroy(linger=0)


@contextlib.asynccontextmanager
async def engine_and_client(
    tmp_path: Path,
) -> AsyncIterator[tuple[zmq.asyncio.Socket, ZmqEngineClient, list[float]]]:
    """An engine's request socket and a started client on a clock the test moves
    (`now[0]`), connected and told the engine's status; both closed after."""
    addresses = EngineAddresses.in_directory(tmp_path)
    context = zmq.asyncio.Context()
    engine = context.socket(zmq.ROUTER)
    engine.bind(addresses.requests)
    now = [time.monotonic()]
    client = ZmqEngineClient(addresses, clock=lambda: now[0])
    await client.start()
    try:
        await connected(client)
        client._subscriber.take(status("e", now[0]))
        yield engine, client, now
    finally:
        await client.close()
        context.destroy(linger=0)


async def test_a_stale_engine_is_told_to_cancel_what_it_was_sent(tmp_path: Path) -> None:
    """Its status stale, the engine may only have stalled: the front end answered 503 but
    sent no Cancel (none could go without a current status), and an engine that recovered
    computed the request for nobody. Its later statuses are heard again."""
    async with engine_and_client(tmp_path) as (engine, client, now):
        requesting = asyncio.create_task(one_request(client))
        _, data = await asyncio.wait_for(engine.recv_multipart(), 10)
        submit = decode_to_engine(data)
        assert isinstance(submit, Submit)
        now[0] += STALE_AFTER_S + 1  # the engine's loop stalls: no status for a while
        assert client.status() is None
        with pytest.raises(Rejected, match="stopped answering") as lost:
            await asyncio.wait_for(requesting, 10)
        assert lost.value.reason is RejectReason.ENGINE_LOST
        _, data = await asyncio.wait_for(engine.recv_multipart(), 10)
        assert decode_to_engine(data) == Cancel(submit.request_id)
        client._subscriber.take(status("e", time.monotonic() + STALE_AFTER_S + 2))  # it recovers
        assert client.status() is not None


async def test_a_stale_status_fails_open_requests_with_nothing_reading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staleness was noticed only when something read the status (a new request, a probe,
    a send): with no arrivals, or during a drain, open requests waited out their deadline
    (+ 5 s) instead of the 503 the front end owes them after STALE_AFTER_S of silence."""
    monkeypatch.setattr("app.engine.zmq_client.STALE_CHECK_INTERVAL_S", 0.01)
    async with engine_and_client(tmp_path) as (engine, client, now):
        request = Submit(client.next_request_id(), "m", time.monotonic() + 60, EmbedPayload([[1]]))
        requesting = asyncio.create_task(anext(aiter(client.stream(request))))
        _, data = await asyncio.wait_for(engine.recv_multipart(), 10)
        assert isinstance(decode_to_engine(data), Submit)
        now[0] += STALE_AFTER_S + 1  # silent since; nothing here reads the status
        with pytest.raises(Rejected, match="stopped answering"):
            await asyncio.wait_for(requesting, 10)
    assert all(task.done() for task in client._tasks)  # the timer ends with the client


async def test_an_answer_that_arrived_before_its_engine_exited_is_not_lost(
    tmp_path: Path,
) -> None:
    """An engine sends a request's final output, then exits. Its connection's close (the
    socket monitor's event) and the answer waiting on the socket were read by two tasks in
    no set order: with the close handled first, the stream was failed 503 `engine_lost`
    (not to be retried elsewhere) ahead of its answer, which was discarded. And with
    IMMEDIATE, libzmq itself threw the unread answer away once it saw the close. Here the
    close is handled first for certain: the event loop no longer reads the sockets, and the
    test hands the client the close once it is there."""
    addresses = EngineAddresses.in_directory(tmp_path)
    context = zmq.asyncio.Context()
    engine = context.socket(zmq.ROUTER)
    engine.bind(addresses.requests)
    client = ZmqEngineClient(addresses)
    await client.start()
    try:
        await connected(client)
        client._subscriber.take(status("e", time.monotonic()))
        dealer = client._dealer
        assert dealer.requests is not None and dealer.events is not None
        loop = asyncio.get_running_loop()
        loop.remove_reader(dealer.requests.FD)
        loop.remove_reader(dealer.events.FD)
        request = Submit(client.next_request_id(), "m", time.monotonic() + 60, EmbedPayload([[1]]))
        requesting = asyncio.create_task(anext(aiter(client.stream(request))))
        origin, data = await asyncio.wait_for(engine.recv_multipart(), 10)
        assert decode_to_engine(data) == request
        vectors = EmbedOutput(b"\0" * 4, rows=1, width=1, input_tokens=1)
        final = Output(request.request_id, True, vectors, queue_s=0.0, compute_s=0.0)
        await engine.send_multipart([origin, encode_batch([final])])
        engine.close(linger=10_000)  # the answer leaves, then the connection closes
        assert dealer.events.poll(10_000)  # the close is there (and the answer before it)
        dealer.take_events()
        assert await asyncio.wait_for(requesting, 10) == final
        assert client.status() is None  # and the engine is taken for gone
    finally:
        await client.close()
        context.destroy(linger=0)


@pytest.mark.parametrize("when", ["queued before it died", "sent before its death was heard"])
async def test_a_request_for_an_engine_that_died_never_reaches_the_next_one(
    tmp_path: Path, when: str
) -> None:
    """Without IMMEDIATE, libzmq kept the DEALER's outgoing queue across a reconnect and
    flushed it to the next engine: requests still queued when the engine died, and those
    sent after its death but before its close was heard. Their clients were answered 503
    already, yet the new engine counted them as taken from this front end (whose count had
    restarted at zero: its shedding let in that many more) or computed them for nobody."""
    addresses = EngineAddresses.in_directory(tmp_path)
    context = zmq.asyncio.Context()
    engine = context.socket(zmq.ROUTER)
    engine.setsockopt(zmq.RCVHWM, 1)  # reads nothing: the rest waits in the client's queue
    engine.bind(addresses.requests)
    client = ZmqEngineClient(addresses)
    await client.start()

    try:
        await connected(client)
        client._subscriber.take(status("e", time.monotonic()))
        if when == "queued before it died":
            # 8 MB: far more than the dead engine's socket and the kernel's buffer hold.
            requesting = [asyncio.create_task(one_request(client, 1_000_000)) for _ in range(8)]
            await asyncio.sleep(0)  # each task's first step sends its request
            assert client.open_streams == len(requesting)
            engine.close(linger=0)
        else:
            engine.close(linger=0)
            dealer = client._dealer
            assert dealer.events is not None and dealer.events.poll(10_000)  # the close is in
            # As when the I/O thread posts the close just after the sends look for it.
            take_events = dealer.take_events
            dealer.take_events = lambda: None  # type: ignore[method-assign]
            requesting = [asyncio.create_task(one_request(client, 1)) for _ in range(3)]
            await asyncio.sleep(0)
            assert client.open_streams == len(requesting)
            dealer.take_events = take_events  # type: ignore[method-assign]
            dealer.take_events()
        for lost in asyncio.as_completed(requesting, timeout=10):
            with pytest.raises(Rejected, match="exited"):
                await lost
        engine = context.socket(zmq.ROUTER)  # the next engine, at the same address
        engine.bind(addresses.requests)
        await connected(client)
        client._subscriber.take(status("f", time.monotonic()))
        after = Submit(client.next_request_id(), "m", time.monotonic() + 60, EmbedPayload([[2]]))
        requesting = [asyncio.create_task(anext(aiter(client.stream(after))))]
        _, data = await asyncio.wait_for(engine.recv_multipart(), 10)
        assert decode_to_engine(data) == after  # the first, and only, it is sent
        requesting[0].cancel()
    finally:
        await client.close()
        context.destroy(linger=0)


async def test_an_answer_that_arrives_as_a_request_is_sent_is_read(tmp_path: Path) -> None:
    """ZeroMQ's descriptor is edge-triggered: a send may take in the notice that an answer
    arrived, after which the descriptor never says so and the event loop never reads it
    (nor any answer after it: the socket's reader is awake, so none is noticed again)."""
    async with engine_and_client(tmp_path) as (engine, client, _):
        dealer = client._dealer
        assert dealer.requests is not None
        first = Submit(client.next_request_id(), "m", time.monotonic() + 60, EmbedPayload([[1]]))
        requesting = asyncio.create_task(anext(aiter(client.stream(first))))
        origin, _ = await asyncio.wait_for(engine.recv_multipart(), 10)
        vectors = EmbedOutput(b"\0" * 4, rows=1, width=1, input_tokens=1)
        final = Output(first.request_id, True, vectors, queue_s=0.0, compute_s=0.0)
        await engine.send_multipart([origin, encode_batch([final])])
        # With no turn of the event loop between: the answer's arrival is signalled ...
        assert select.select([dealer.requests.FD], [], [], 10)[0]
        # ... and a send after libzmq's command throttle (about 1 ms) takes the signal in.
        time.sleep(0.01)  # noqa: ASYNC251 (not to synchronise: the loop must not turn)
        client._send(Submit(client.next_request_id(), "m", time.monotonic() + 60, first.payload))
        assert await asyncio.wait_for(requesting, 10) == final


async def test_answers_arriving_in_bursts_between_sends_are_all_read(tmp_path: Path) -> None:
    """Many requests, sent while the answers to earlier ones arrive in bursts from an engine
    on another thread: none waits on the socket unread (a lost wake-up)."""
    addresses = EngineAddresses.in_directory(tmp_path)
    context = zmq.Context()
    engine = context.socket(zmq.ROUTER)
    engine.setsockopt(zmq.LINGER, 0)
    engine.bind(addresses.requests)
    stop = threading.Event()

    def serve() -> None:  # answers what has come, in one burst per wake
        vectors = EmbedOutput(b"\0" * 4, rows=1, width=1, input_tokens=1)
        while not stop.is_set():
            if not engine.poll(10):
                continue
            burst: list[list[bytes]] = []
            while engine.poll(0):
                burst.append(engine.recv_multipart())
            for origin, data in burst:
                submit = decode_to_engine(data)
                if isinstance(submit, Submit):
                    final = Output(submit.request_id, True, vectors, queue_s=0.0, compute_s=0.0)
                    engine.send_multipart([origin, encode_batch([final])])

    server = threading.Thread(target=serve)
    server.start()
    client = ZmqEngineClient(addresses)
    await client.start()

    try:
        await connected(client)
        client._subscriber.take(status("e", time.monotonic()))
        for _ in range(20):
            requesting = []
            for _ in range(100):
                requesting.append(asyncio.create_task(one_request(client)))
                await asyncio.sleep(0)
            answers = await asyncio.wait_for(asyncio.gather(*requesting), 10)
            assert all(len(outputs) == 1 and outputs[0].final for outputs in answers)
    finally:
        await client.close()
        stop.set()
        server.join()
        context.destroy(linger=0)
