"""The front end's DEALER to the engine's ROUTER and the monitor that says when its connection
opens and closes (`docs/ARCHITECTURE.md §9`). Plain (not asyncio) sockets, read by one
event-loop reader callback on both sockets' file descriptors: every answer there, then
every connection event, each taken off its socket until none is left, so a closed
connection's answers are handed on before its close. Front-end event loop thread only.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

_MONITOR_ADDRESSES = itertools.count(1)


def _readable(socket: zmq.Socket[bytes]) -> bool:
    """Whether a message waits (asking takes in the socket's notices: see `EngineDealer`)."""
    pending = socket.get(zmq.EVENTS)
    return isinstance(pending, int) and bool(pending & zmq.POLLIN)


class EngineDealer:
    """The connection to the engine that requests go out on and answers come back on.

    Not IMMEDIATE: with it libzmq tears down the connection's pipe when the engine's socket
    closes, and the answers the engine sent last, arrived but not read yet, are thrown away.
    Without it libzmq keeps the outgoing queue across a reconnect and hands it to whatever
    engine binds next (requests the front end already answered 503), so a closed connection
    ends its sockets: what arrived on it is read, then the DEALER (LINGER 0: its queue is
    discarded) and its monitor are closed and fresh ones connected. `connected` is false
    until the new monitor says the new socket connected; `send` refuses while it is.

    ZeroMQ's file descriptor is edge-triggered: any operation on a socket may take in the
    notice that a message arrived, and the descriptor then never says so. Every drain reads
    until nothing is left, and every send looks whether answers wait and drains soon if
    they do, so no wake-up is lost."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        address: str,
        identity: bytes,
        on_answer: Callable[[bytes], None],
        on_closed: Callable[[], None],
    ) -> None:
        """`on_answer(data)`: one frame from the engine; `on_closed()`: the connection
        closed, after every answer that arrived on it went to `on_answer`."""
        self._context = context
        self._address = address
        self._identity = identity
        self._on_answer = on_answer
        self._on_closed = on_closed
        self._loop: asyncio.AbstractEventLoop | None = None
        self.requests: zmq.Socket[bytes] | None = None
        self.events: zmq.Socket[bytes] | None = None
        self.connected = False  # as the monitor last said
        self._drain_due = False

    def open(self) -> None:
        """Connect (again: a fresh socket each time); read from now on."""
        self._loop = asyncio.get_running_loop()
        requests = self._context.socket(zmq.DEALER)
        requests.setsockopt(zmq.IDENTITY, self._identity)
        requests.setsockopt(zmq.SNDHWM, 0)
        requests.setsockopt(zmq.RCVHWM, 0)
        requests.setsockopt(zmq.LINGER, 0)
        requests.setsockopt(zmq.RECONNECT_IVL, 50)
        # A name of its own: a closed socket's monitor endpoint is released asynchronously.
        events = requests.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED,
            f"inproc://engine-dealer-monitor-{next(_MONITOR_ADDRESSES)}",
        )
        events.setsockopt(zmq.LINGER, 0)
        requests.connect(self._address)
        self.requests, self.events, self.connected = requests, events, False
        self._loop.add_reader(requests.FD, self.drain)
        self._loop.add_reader(events.FD, self.drain)
        self._drain_soon()  # what came before the readers were added

    def close(self) -> None:
        """Stop reading and close both sockets; what is still queued is discarded."""
        requests, events = self.requests, self.events
        self.requests = self.events = None
        self.connected = False
        if self._loop is not None and requests is not None and events is not None:
            self._loop.remove_reader(requests.FD)
            self._loop.remove_reader(events.FD)
            requests.disable_monitor()
            events.close(linger=0)
            requests.close(linger=0)

    def send(self, data: bytes) -> bool:
        """Queue `data` without waiting; False when it could not be (not connected)."""
        requests = self.requests
        if requests is None or not self.connected:
            return False
        try:
            requests.send(data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        finally:
            # The send may have taken in an answer's arrival: its descriptor will not say.
            if _readable(requests):
                self._drain_soon()
        return True

    def drain(self) -> None:
        """Answers first, then connection events: a close is handled after what came on it."""
        self._drain_due = False
        self.take_arrived()
        self.take_events()

    def take_arrived(self) -> None:
        """Hand on every answer the socket holds now, without waiting. On a closed
        connection these are all the closed engine's: the next engine gets a fresh socket."""
        while (requests := self.requests) is not None:
            try:
                data = requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_answer(data)

    def take_events(self) -> None:
        """The connection's changes the monitor holds now, without waiting. A close hands
        on what arrived, then the sockets are replaced (events still queued on the old
        monitor are the old socket's), then `on_closed()`."""
        while (events := self.events) is not None:
            # Asked first: cheaper than a refused read, and every send asks.
            if not _readable(events):
                return
            frames = events.recv_multipart(zmq.NOBLOCK)
            try:
                event = parse_monitor_message(frames)["event"]
            except Exception:  # not one of libzmq's events: nothing to act on
                continue
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.take_arrived()
                self.close()
                self.open()
                self._on_closed()
                return

    def _drain_soon(self) -> None:
        if not self._drain_due and self._loop is not None:
            self._drain_due = True
            self._loop.call_soon(self.drain)
