"""A drain gives up after its timeout in real time, whatever clock the service's deadlines
are on: the drain timeout is what the pod's grace period is sized for (check-config)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import cast

from app.drain import Drain
from app.engine.client import EngineClient
from app.metrics import Metrics
from app.service import Service
from app.settings import Settings
from tests.support.manual_clock import ManualClock


async def keep_arriving(drain: Drain) -> None:
    """Clients that keep arriving (to hear 503) more often than the quiet period."""
    while True:
        drain.arrived()
        await asyncio.sleep(0.01)


async def test_clients_that_keep_arriving_end_the_drain_at_its_timeout_on_a_frozen_clock() -> None:
    """It measured what was left of its timeout on the service's clock and waited in real
    time: on a clock that does not move (tests freeze it), what was left never shrank, and
    arrivals every 10 ms kept it waiting for ever."""
    no_engine = cast(EngineClient, object())  # a drain never reaches it
    service = Service(Settings(), Metrics(), no_engine, clock=ManualClock(1000.0))
    drain = service.drain
    drain.begin()  # nothing in flight: idle at once
    arrivals = asyncio.create_task(keep_arriving(drain))
    try:
        assert await asyncio.wait_for(drain.wait(timeout_s=0.2, quiet_s=0.1), 5)
    finally:
        arrivals.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await arrivals
