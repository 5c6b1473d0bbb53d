"""A connection whose client stopped reading its answer is aborted, not held forever.

Nothing else gives up on a client that keeps its connection open and reads nothing:
uvicorn's `send` waits for a paused transport (its buffer over the 64 KiB high-water mark)
to drain with no timeout, and a transport's `close` waits for its buffer to empty and never
aborts (asyncio's and uvloop's alike). A streamed answer so stalled kept its request's place
under the in-flight cap (`SheddingMiddleware` leaves it once the answer ends), its engine
requests and the outputs queued for them; a large answer (embeddings, v2 tensors) left
unread when its connection closed (keep-alive timeout, `Connection: close`) kept its bytes,
its socket and a place under `max_connections`. Forever, for a front end reached directly:
512 stalled streams and every request was refused 429 `inflight`.

`StallLimitedTransport` is the transport the HTTP protocol (`api/header_limits.py`) uses.
Once its writes pause, or it closes with bytes still buffered (by `close`, or by itself
after the client's end of input), a look `limit_s` later finds what the client has taken
since the last: the bytes written to the transport (its `write` counts them) less those
it has yet to take (the buffer, and the socket's send queue behind it). Some, it looks
again one limit later; none, with bytes still untaken, and the transport is aborted (the
bytes already in the kernel's queue are the kernel's to send or drop) and counted. What
was taken, not a fall in what is left: the app writes on while the writes are paused (the
buffer swings between the low and high water marks as it refills) and while the
transport closes after the client's end of input (asyncio's and uvloop's take writes
until the connection is lost: a client that half-closed after its request and reads its
stream on), so what a steady reader has yet to take need not fall from look to look. The
protocol's `connection_lost` then wakes uvicorn's `send` as a disconnect: the request's
watcher (`api/cancellation.py`) cancels its work, its place is left, its connection freed.
`WRITE_STALL_S` is the shipped Envoy's `stream_idle_timeout` (30 s, deploy/envoy): behind
it a client that takes nothing for that long is reset anyway; a slow reader that takes
some in each 30 s keeps its connection.

The probe listener (`app/probes.py`) aborts an answer its reader did not take with the same
`abort_unflushed`. Event loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import struct
import termios
from collections.abc import Callable, Iterable
from typing import Any

# The shipped Envoy's `stream_idle_timeout` (deploy/envoy/envoy.yaml).
WRITE_STALL_S = 30.0


def abort_unflushed(transport: asyncio.WriteTransport) -> bool:
    """Abort `transport` if its buffer still holds bytes its reader has not taken (closing
    it would wait for them forever); whether it did."""
    if transport.get_write_buffer_size():
        transport.abort()
        return True
    return False


def send_queue(transport: asyncio.BaseTransport) -> int:
    """Bytes in the socket's send queue, not yet acknowledged by the client (Linux's
    SIOCOUTQ); 0 without a socket."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    with contextlib.suppress(OSError):
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        return int(struct.unpack("i", queued)[0])
    return 0


class StallLimitedTransport:
    """`transport` as the protocol uses it, aborted (and `stalled` called) once its client
    takes none of what was written for `limit_s`, while its writes are paused
    (`writing_paused`, `writing_resumed`: the protocol's flow control) or once it closes
    with bytes left (`close`, or `closing` where it closes itself). `lost`: its connection
    is gone. Every write must go through it (`write`, `writelines`: counted)."""

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        limit_s: float,
        stalled: Callable[[], None],
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._limit_s = limit_s
        self._stalled = stalled
        self._look: asyncio.TimerHandle | None = None
        self._written = 0  # every byte written to the transport
        self._taken = 0  # what the client had taken at the last look
        self._lost = False
        # What every request calls goes straight to the transport (`write` counts).
        self.is_closing = transport.is_closing
        self.get_extra_info = transport.get_extra_info
        self.pause_reading = transport.pause_reading
        self.resume_reading = transport.resume_reading

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._written += len(data)
        self._transport.write(data)

    def writelines(self, data: Iterable[bytes | bytearray | memoryview]) -> None:
        data = list(data)
        self._written += sum(map(len, data))
        self._transport.writelines(data)

    def close(self) -> None:
        self._transport.close()
        self.closing()

    def closing(self) -> None:
        """The transport closes once its buffer is empty: that must happen within the limit."""
        if not self._lost and self._transport.get_write_buffer_size():
            self._watch()

    def writing_paused(self) -> None:
        if not self._lost:
            self._watch()

    def writing_resumed(self) -> None:
        if not self._transport.is_closing():  # closing: its buffer must still empty
            self._stop()

    def lost(self) -> None:
        self._lost = True
        self._stop()

    def _watch(self) -> None:
        if self._look is None:
            self._taken = self._taken_now()
            self._look = self._loop.call_later(self._limit_s, self._looked)

    def _taken_now(self) -> int:
        """What the client has taken of all that was written: all but what it has yet to
        take, the buffer and the socket's send queue behind it (the buffer refills the
        queue only once it has emptied by half: a slow reader's progress shows there
        first). It only grows, however the app tops the buffer up."""
        untaken = self._transport.get_write_buffer_size() + send_queue(self._transport)
        return self._written - untaken

    def _looked(self) -> None:
        self._look = None
        taken = self._taken_now()
        if taken > self._taken:  # the client took some: one limit more
            self._taken = taken
            self._look = self._loop.call_later(self._limit_s, self._looked)
        elif abort_unflushed(self._transport):
            self._stalled()

    def _stop(self) -> None:
        if self._look is not None:
            self._look.cancel()
            self._look = None
