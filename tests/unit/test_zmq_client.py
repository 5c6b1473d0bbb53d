"""The front end's ZeroMQ engine client when the engine is gone: a request sent then is
refused at once (503), and the dead engine's last statuses, read late, do not bring it back
as ready. Real ZeroMQ sockets on a private IPC directory, no engine process."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from app.engine.client import EngineUnavailable
from app.engine.protocol import (
    EmbedPayload,
    EngineStatus,
    Submit,
    frontend_identity,
    identity_pid,
)
from app.engine.zmq_client import NEW_ENGINE, EngineAddresses, StatusSubscriber, ZmqEngineClient


def status(engine_id: str, published_at: float) -> EngineStatus:
    return EngineStatus(
        engine_id=engine_id,
        pid=1,
        state="ready",
        warmup_done=0,
        warmup_total=0,
        healthy=True,
        backlog_s=0.0,
        seconds_per_input=0.0,
        queued_inputs=0,
        published_at=published_at,
    )


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
        with pytest.raises(EngineUnavailable, match="no engine is connected"):
            async for _ in client.stream(request):
                pass
        assert client.open_streams == 0
    finally:
        await client.close()


def test_a_forgotten_engines_late_statuses_do_not_bring_it_back() -> None:
    now = [100.0]
    lost: list[str] = []
    subscriber = StatusSubscriber(None, "", clock=lambda: now[0], on_lost=lost.append)  # type: ignore[arg-type]
    subscriber.take(status("a", 99.9))
    now[0] = 100.1
    subscriber.forget()  # its connection closed
    # Published before it died, read after: the engine stays forgotten.
    subscriber.take(status("a", 100.05))
    assert subscriber.status() is None
    # Published after the forget: it is alive after all (a loop that was late).
    subscriber.take(status("a", 100.2))
    assert subscriber.status() == status("a", 100.2)
    # A replacement is heard, and reported as a new engine.
    subscriber.take(status("b", 100.3))
    assert subscriber.status() == status("b", 100.3) and lost == [NEW_ENGINE]


def test_a_front_ends_identity_names_its_process() -> None:
    """What the supervisor's `FrontEndGone(pid)` is matched against in the engine."""
    assert identity_pid(frontend_identity(4242, 0xABC)) == 4242
    for other in (b"", b"supervisor", b"fe-x-1", b"xx-12-1", "fe-\u00b2-1".encode()):
        assert identity_pid(other) is None
