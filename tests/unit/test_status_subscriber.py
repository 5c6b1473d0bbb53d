"""The front end's subscription to the engine's status: an unreadable status is skipped, and
after a stall the newest status is heard, not what queued before it. Real ZeroMQ sockets on
a private IPC directory, no engine process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import zmq
import zmq.asyncio

from app.engine.protocol import EngineStatus, encode
from app.engine.zmq_client import EngineAddresses, StatusSubscriber
from tests.support.engine_status import ready_status


def status(engine_id: str, published_at: float) -> EngineStatus:
    return ready_status(engine_id, published_at)


async def test_an_unreadable_status_is_skipped(tmp_path: Path) -> None:
    addresses = EngineAddresses.in_directory(tmp_path)
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(addresses.status)
    subscriber = StatusSubscriber(context, addresses.status)
    subscriber.start()
    try:
        for _ in range(1000):  # until the subscription has reached the publisher
            await publisher.send(b"\xc1 not msgpack")
            await publisher.send(encode(status("e", time.monotonic())))
            if subscriber.status() is not None:
                break
            await asyncio.sleep(0.01)
        assert subscriber.status() is not None
        task = subscriber._subscription._task
        assert task is not None and not task.done()
    finally:
        await subscriber.close()
        context.destroy(linger=0)


async def test_after_a_stall_the_latest_status_is_read_not_what_queued_before_it(
    tmp_path: Path,
) -> None:
    """Statuses published while the subscriber's loop does not read: the newest is heard,
    and few of those before it. With a queue the loop read every status published during
    its stall, oldest first, each taken as fresh (and the engine's publisher, its own queue
    full behind the subscriber's 16, dropped the newest). The publisher here queues without
    limit, so every status reaches the subscriber and none is dropped on the way."""
    addresses = EngineAddresses.in_directory(tmp_path)
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.SNDHWM, 0)
    publisher.bind(addresses.status)
    heard: list[float] = []
    subscriber = StatusSubscriber(
        context, addresses.status, on_status=lambda status: heard.append(status.published_at)
    )
    subscriber.start()
    published = 20_000
    try:
        for _ in range(1000):  # until the subscription has reached the publisher
            await publisher.send(encode(status("e", 0.0)))
            if heard:
                break
            await asyncio.sleep(0.01)
        assert heard
        heard.clear()
        # The loop does not turn between these sends: the subscriber reads none of them.
        sent = [publisher.send(encode(status("e", float(n)))) for n in range(1, published + 1)]
        assert all(send.done() for send in sent)
        for _ in range(1000):  # a bound on the wait, not a timing: a failure past it
            if heard and heard[-1] == published:
                break
            await asyncio.sleep(0.01)
        assert heard and heard[-1] == published, heard[-3:]
        # Each read takes the latest: one per turn of the loop, not one per status.
        assert len(heard) < published // 2, len(heard)
    finally:
        await subscriber.close()
        context.destroy(linger=0)
