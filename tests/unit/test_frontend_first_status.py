"""A front end (re)started does not serve before it has heard the engine's status, for a
bounded time: its start-up returned once its sockets were open, and the engine sends an
unchanged status only every STATUS_HEARTBEAT_S, so until then its /readyz said 503 "no
engine is connected (restarting?)" and its requests were refused 503 with the engine fine.
Real ZeroMQ sockets on a private IPC directory; the engine is a stand-in publisher that
publishes once it hears the front end subscribe (an XPUB socket), as the engine's heartbeat
would reach it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from app.engine import zmq_client
from app.engine.protocol import encode
from app.engine.zmq_client import EngineAddresses, ZmqEngineClient
from app.metrics import Metrics
from app.model_specs import ModelSpec
from app.probes import READYZ, probe_response
from app.service import Service
from app.settings import Settings
from tests.support.engine_status import ready_status


def no_tokenizer(spec: ModelSpec, largest: int) -> Any:
    return object()


def readyz(service: Service) -> tuple[int, dict[str, Any]]:
    status, body = probe_response(READYZ, service.readiness(), service.liveness())
    return status, json.loads(body)


async def publish_on_subscription(publisher: zmq.asyncio.Socket) -> None:
    """The stand-in engine: a ready status once a subscriber has subscribed."""
    subscription = await publisher.recv()
    assert subscription[:1] == b"\x01"
    await publisher.send(encode(ready_status("e", time.monotonic())))


@pytest.fixture
def addresses(tmp_path: Path) -> EngineAddresses:
    return EngineAddresses.in_directory(tmp_path)


async def test_a_front_end_starts_once_it_has_heard_the_engines_status(
    addresses: EngineAddresses, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bound that no machine's slowness reaches: what is tested is that start-up waits.
    monkeypatch.setattr(zmq_client, "FIRST_STATUS_WAIT_S", 60.0)
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.XPUB)
    publisher.bind(addresses.status)
    engine = asyncio.create_task(publish_on_subscription(publisher))
    service = Service(Settings(), Metrics(), ZmqEngineClient(addresses), no_tokenizer)
    try:
        await asyncio.wait_for(service.start(), 30)
        assert service.started
        assert readyz(service)[0] == 200, readyz(service)
        await asyncio.wait_for(engine, 30)
    finally:
        engine.cancel()
        await asyncio.gather(engine, return_exceptions=True)
        await service.stop()
        context.destroy(linger=0)


async def test_a_front_end_starts_anyway_when_no_engine_publishes(
    addresses: EngineAddresses, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine may really be down: the front end serves its 503s, and the supervisor's
    probe port says so meanwhile."""
    monkeypatch.setattr(zmq_client, "FIRST_STATUS_WAIT_S", 0.01)
    service = Service(Settings(), Metrics(), ZmqEngineClient(addresses), no_tokenizer)
    try:
        await asyncio.wait_for(service.start(), 30)
        assert service.started
        status, body = readyz(service)
        assert (status, body["problem"]) == (503, "no engine is connected (restarting?)")
    finally:
        await service.stop()


def test_the_wait_outlasts_a_few_heartbeats() -> None:
    assert 2 * zmq_client.STATUS_HEARTBEAT_S <= zmq_client.FIRST_STATUS_WAIT_S
    assert zmq_client.FIRST_STATUS_WAIT_S <= 3 * zmq_client.STATUS_HEARTBEAT_S
