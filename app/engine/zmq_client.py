"""The front end's connection to an engine process, over ZeroMQ (as vLLM's API server talks
to its engine core): a DEALER socket carries requests and their outputs (`zmq_dealer.py`), a SUB
socket the engine's status within milliseconds of a change.

The engine going away is noticed two ways: the DEALER's connection closes (the kernel closes
it the moment the process dies) and the status goes stale. Either way every open stream is
answered at once with a retryable 503, and no request is sent until an engine publishes
again. A stale status proves nothing dead (a loop that stalled may recover, and its later
statuses are heard): those streams send `Cancel`, which reaches it if it does. Front-end
event loop thread only. Torch-free.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import zmq
import zmq.asyncio

from app.engine.client import (
    ANSWER_UNREADABLE,
    ENGINE_EXITED,
    ENGINE_WENT_SILENT,
    EngineNotConnected,
    EngineUnavailable,
    StreamingClient,
)
from app.engine.identity import frontend_identity
from app.engine.protocol import (
    PROTOCOL_CLOCK,
    Cancel,
    EngineRestart,
    EngineStatus,
    ToEngine,
    decode_batch_from_engine,
    decode_restart,
    decode_status,
    encode,
)
from app.engine.zmq_dealer import EngineDealer

log = logging.getLogger(__name__)

# The engine looks for a status change to publish every STATUS_INTERVAL_S. A dead engine is
# noticed at once (its socket closes); silence for STALE_AFTER_S means a hung one (its event
# loop stopped). That bound is long on purpose: a front end whose own loop was held up (a slow
# test fixture, a GC pause) must not take a live engine for a hung one and fail its requests.
STATUS_INTERVAL_S = 0.005
# An unchanged status is sent again this often (a front end that connects hears it within
# this; far inside STALE_AFTER_S).
STATUS_HEARTBEAT_S = 0.1
# A front end (re)started waits this long at most for the engine's first status before it
# serves: until one is heard its /readyz says no engine is connected and its requests are
# refused 503, the engine fine. Past it the engine may really be down; it starts anyway (its
# 503s say so, and the supervisor's probe port covers the replica meanwhile).
FIRST_STATUS_WAIT_S = 3 * STATUS_HEARTBEAT_S
# The supervisor publishes the engine restart under way (or None) on each change and at
# least this often (`EngineSupervisor`): a front end that connects late hears it within this.
RESTART_HEARTBEAT_S = 1.0
STALE_AFTER_S = 10.0
# A front end looks this often whether its status went stale, on a timer of its own: read
# only by a request, a probe or a send, it was not seen with nothing arriving (or during a
# drain, which refuses before it reads the status), and open requests waited out their
# deadlines instead of the 503 STALE_AFTER_S promises.
STALE_CHECK_INTERVAL_S = 1.0
# Why a status subscriber reports its engine lost (`on_lost`).
STATUS_WENT_STALE = "its status went stale"
NEW_ENGINE = "a new engine replaced it"


@dataclass(frozen=True, slots=True)
class EngineAddresses:
    """The engine's sockets, and the supervisor's (`restarts`: where it publishes the
    `EngineRestart` under way; None: no supervisor publishes one)."""

    requests: str
    status: str
    restarts: str | None = None

    @classmethod
    def in_directory(cls, directory: Path) -> EngineAddresses:
        """IPC endpoints in a private run directory (one engine per directory)."""
        return cls(
            requests=f"ipc://{directory / 'engine-requests.sock'}",
            status=f"ipc://{directory / 'engine-status.sock'}",
            restarts=f"ipc://{directory / 'engine-restarts.sock'}",
        )


def send_now(socket: zmq.asyncio.Socket, data: bytes) -> bool:
    """Queue `data` on `socket` without waiting; False when it could not be (no peer
    connected, with IMMEDIATE). zmq.asyncio puts a failed send's error (zmq.Again) on the
    future it returns, and raises nothing. Event loop thread only."""
    sent = socket.send(data, zmq.NOBLOCK)
    assert isinstance(sent, asyncio.Future)
    return not (sent.done() and sent.exception() is not None)


M = TypeVar("M")  # a message a subscription decodes


class Subscription(Generic[M]):
    """The messages a PUB socket at `address` publishes, decoded (`decode`) and handed to
    `take`, on a task of its own (`name`): the latest at each read, each message being the
    whole current state (a status, a restart). A message that does not decode is logged
    (`what`) and skipped: its publisher sends the next soon. Event loop thread only."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        address: str,
        name: str,
        decode: Callable[[bytes], M],
        take: Callable[[M], None],
        what: str,
    ) -> None:
        self._context = context
        self._address = address
        self._name = name
        self._decode = decode
        self._take = take
        self._what = what
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.LINGER, 0)
        # Only the latest: with a queue, a loop that stalled read what was published before
        # the stall (the publisher drops what comes once the queue is full, the newest) and
        # took it as fresh, restarting the staleness clock on an old word.
        socket.setsockopt(zmq.CONFLATE, 1)
        socket.connect(self._address)
        self._task = asyncio.create_task(self._receive(socket), name=self._name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _receive(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            data = await socket.recv()
            try:
                message = self._decode(data)
            except Exception:
                log.exception("%s could not be read", self._what)
                continue
            self._take(message)


class StatusSubscriber:
    """The engine's published status, from its PUB socket. Event loop thread of the process
    that holds it (a front end, or the supervisor for its probe listener)."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        address: str,
        clock: Callable[[], float] = time.monotonic,
        on_lost: Callable[[str], None] = lambda why: None,
        on_status: Callable[[EngineStatus], None] = lambda status: None,
    ) -> None:
        """`on_lost(why)` is called when the status goes stale or a new engine appears;
        `on_status(status)` with each status heard (a dead engine's late ones left out).
        `clock` times staleness only: when a status was published is on PROTOCOL_CLOCK."""
        self._context = context
        self._address = address
        self._clock = clock
        self._on_lost = on_lost
        self._on_status = on_status
        self._status: EngineStatus | None = None
        self._received_at = 0.0
        self._last_engine_id: str | None = None
        # (engine id, when on PROTOCOL_CLOCK): an engine forgotten then, whose statuses
        # published earlier are not heard.
        self._forgotten: tuple[str, float] | None = None
        self._subscription = Subscription(
            context, address, "engine-status", decode_status, self.take, "an engine status"
        )

    def start(self) -> None:
        self._subscription.start()

    async def close(self) -> None:
        await self._subscription.close()

    def status(self) -> EngineStatus | None:
        if self._status is None:
            return None
        if self._clock() - self._received_at > STALE_AFTER_S:
            self._status = None
            self._on_lost(STATUS_WENT_STALE)
        return self._status

    def forget(self) -> None:
        """The engine is gone: no status until a new one publishes. What it published
        before now and this loop has not read yet (a loop running late reads them after
        the disconnect) is not heard: it would bring a dead engine back as ready."""
        self._status = None
        if self._last_engine_id is not None:
            self._forgotten = (self._last_engine_id, PROTOCOL_CLOCK())

    def take(self, status: EngineStatus) -> None:
        """A status as published (its `published_at` is on PROTOCOL_CLOCK, the engine
        process's, read the same here on one machine)."""
        forgotten = self._forgotten
        if (
            forgotten is not None
            and status.engine_id == forgotten[0]
            and status.published_at <= forgotten[1]
        ):
            return
        previous = self._status
        if previous is not None and previous.engine_id != status.engine_id:
            self._on_lost(NEW_ENGINE)
        self._status = status
        self._last_engine_id = status.engine_id
        self._received_at = self._clock()
        self._on_status(status)


class RestartSubscriber:
    """The engine restart under way, as the supervisor last published it (it publishes on
    every change and at least every `RESTART_HEARTBEAT_S`, so a front end started during a
    restart hears it within that): a front end's probes say why the last engine was lost
    until a new one is ready, as the supervisor's own probes do. Event loop thread."""

    def __init__(self, context: zmq.asyncio.Context, address: str) -> None:
        self.restart: EngineRestart | None = None
        self._subscription = Subscription(
            context,
            address,
            "engine-restarts",
            decode_restart,
            self._take,
            "the supervisor's word on the engine restart",
        )

    def start(self) -> None:
        self._subscription.start()

    async def close(self) -> None:
        await self._subscription.close()

    def _take(self, restart: EngineRestart | None) -> None:
        self.restart = restart


class ZmqEngineClient(StreamingClient):
    """Requests go out and answers come back on an `EngineDealer` (`zmq_dealer.py`), which
    hands on a closed connection's answers before its close and gives the next engine a
    fresh socket; the engine's status comes on a SUB socket (`StatusSubscriber`)."""

    def __init__(
        self,
        addresses: EngineAddresses,
        clock: Callable[[], float] = time.monotonic,
        on_status: Callable[[EngineStatus], None] = lambda status: None,
        spawn_token: int | None = None,
    ) -> None:
        """`on_status`: as `StatusSubscriber`'s (the owner of the engine's supervisor hears
        its readiness there); `spawn_token`: the one its supervisor started this front end
        with (`FrontEndGone`), in its identity (else this client's `id`)."""
        unique = id(self) if spawn_token is None else spawn_token
        self._identity = frontend_identity(os.getpid(), unique)
        super().__init__(origin=self._identity, clock=clock)
        self._addresses = addresses
        self._context = zmq.asyncio.Context()
        self._dealer = EngineDealer(
            zmq.Context.shadow(self._context.underlying),
            addresses.requests,
            self._identity,
            on_answer=self._take_answer,
            on_closed=lambda: self._engine_gone("its connection closed"),
        )
        self._status_heard = asyncio.Event()

        def heard(status: EngineStatus) -> None:
            self._status_heard.set()
            on_status(status)

        self._subscriber = StatusSubscriber(
            self._context, addresses.status, clock, on_lost=self._engine_gone, on_status=heard
        )
        self._restarts = (
            RestartSubscriber(self._context, addresses.restarts)
            if addresses.restarts is not None
            else None
        )
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Connect; return once the engine's status is heard, or `FIRST_STATUS_WAIT_S`."""
        self._dealer.open()
        self._subscriber.start()
        if self._restarts is not None:
            self._restarts.start()
        self._tasks = [asyncio.create_task(self._watch_staleness(), name="engine-staleness")]
        try:
            await asyncio.wait_for(self._status_heard.wait(), FIRST_STATUS_WAIT_S)
        except TimeoutError:
            log.info("no engine status within %g s: starting without one", FIRST_STATUS_WAIT_S)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._subscriber.close()
        if self._restarts is not None:
            await self._restarts.close()
        self._dealer.close()  # what status() may still notice delivers nothing now
        self._context.destroy(linger=0)

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        # The engine is another process: its published status is observed until ready.
        give_up_at = self._clock() + timeout_s
        while (status := self.status()) is None or status.state != "ready":
            if status is not None and status.state == "failed":
                raise EngineUnavailable(status.problem or "the engine failed to start")
            if self._clock() > give_up_at:
                raise EngineUnavailable(f"the engine was not ready within {timeout_s:g} s")
            await asyncio.sleep(STATUS_INTERVAL_S)

    def refresh_metrics(self) -> None:
        """The engine process refreshes its own gauges."""

    def status(self) -> EngineStatus | None:
        return self._subscriber.status()

    def restart_under_way(self) -> EngineRestart | None:
        return self._restarts.restart if self._restarts is not None else None

    def _send(self, message: ToEngine) -> None:
        """A request only to an engine whose status is current; a `Cancel` to whatever
        engine the socket still reaches (one whose status went stale may yet recover).
        Nothing while none is connected (as the monitor says at the send, not as a drain
        last heard): a closed connection's socket is replaced, its queue discarded."""
        self._dealer.take_events()
        if not self._dealer.connected:
            raise EngineNotConnected("no engine is connected")
        if not isinstance(message, Cancel) and self.status() is None:
            raise EngineNotConnected("no engine is connected")
        if not self._dealer.send(encode(message)):
            raise EngineNotConnected("no engine is connected")

    async def _watch_staleness(self) -> None:
        """Read the status every `STALE_CHECK_INTERVAL_S`: reading it is what notices that it
        went stale (`StatusSubscriber.status`), and fails the open requests."""
        while True:
            await asyncio.sleep(STALE_CHECK_INTERVAL_S)
            self.status()

    def _engine_gone(self, why: str) -> None:
        """The engine that went away will answer none of what it was sent; one whose status
        went stale may still run it (its streams cancel it there). What it sent before is
        delivered first."""
        self._dealer.take_arrived()
        if self.open_streams:
            log.warning("engine lost (%s): failing %d open requests", why, self.open_streams)
        self._subscriber.forget()
        self._fail_all(ENGINE_WENT_SILENT if why == STATUS_WENT_STALE else ENGINE_EXITED)

    def _take_answer(self, data: bytes) -> None:
        try:
            messages = decode_batch_from_engine(data)
        except Exception:
            # Must not end the reading (every later answer would go unread, each request
            # waiting out its deadline while /readyz said ready): its requests cannot be
            # told apart, so every open one fails at once (503, retryable); the engine
            # still holds them: each is cancelled there as it fails.
            log.exception("an answer from the engine could not be read")
            self._fail_all(ANSWER_UNREADABLE)
            return
        for message in messages:
            self._deliver(message)
