"""The write-stall limit's looks (`app/api/write_stall.py`) on a stand-in transport and a
clock the test moves: a look that finds the client took some waits one limit more, one that
finds nothing aborts; what the client took is its progress however the app tops the buffer
up; and the socket's send queue, which the looks count, holds what the client has yet to
take."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

from app.api.write_stall import StallLimitedTransport, send_queue
from tests.support.manual_timers import ManualTimers

WAIT_S = 10.0  # the most the send-queue test waits: a failure, not a bound on timing


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
    timers = ManualTimers(asyncio.get_running_loop())
    stall = StallLimitedTransport(transport, timers, 1.0, stalled.set)  # type: ignore[arg-type]
    stall.writing_paused()  # 100 bytes buffered
    found: list[int] = []  # what each look found: taken twice, then nothing more

    def looked() -> int:
        found.append(60 if not found else 20)
        return found[-1]

    transport.get_write_buffer_size = looked  # type: ignore[method-assign]
    for _ in range(2):  # each found progress: one limit more
        assert timers.advance(0.75) == []
        assert timers.advance(0.25) == ["_looked"]
        assert not transport.aborted
    assert timers.advance(1.0) == ["_looked"]
    assert transport.aborted
    assert stalled.is_set()
    assert found[:3] == [60, 20, 20]  # two looks found progress; the third found none


async def test_what_the_client_took_is_its_progress_however_the_app_tops_the_buffer_up() -> None:
    """Paused, the buffer swings between the low and high water marks as the app refills
    it: a reader that takes some each limit may show as much buffered at a look as at the
    last, or more."""
    transport = Buffered()
    stalled = asyncio.Event()
    timers = ManualTimers(asyncio.get_running_loop())
    stall = StallLimitedTransport(transport, timers, 1.0, stalled.set)  # type: ignore[arg-type]
    stall.writing_paused()  # 100 bytes buffered
    found: list[int] = []  # what each look found buffered

    def looked() -> int:
        if len(found) < 2:  # since the last look: the client took 50, the app wrote 60
            transport.left -= 50
            stall.write(b"x" * 60)
        found.append(transport.left)
        return transport.left

    transport.get_write_buffer_size = looked  # type: ignore[method-assign]
    for _ in range(2):  # each found progress: one limit more
        assert timers.advance(1.0) == ["_looked"]
        assert not transport.aborted
    assert timers.advance(1.0) == ["_looked"]
    assert transport.aborted
    assert stalled.is_set()
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
