"""An engine's status is stamped on the protocol's clock (`PROTOCOL_CLOCK`), whatever clock
the engine times its own work with: front ends compare `published_at` with their own
readings of that clock (a forgotten engine's late statuses, `zmq_client.StatusSubscriber`),
so a core on an injected clock stamped a time no front end could compare."""

from __future__ import annotations

import time

from app.engine.core import EngineCore
from app.metrics import Metrics
from app.model_specs import ModelSpec
from app.settings import Settings
from tests.support.fake_model import GatedLoader
from tests.support.manual_clock import ManualClock

SETTINGS = Settings(
    models=(ModelSpec(name="a", source="unused"),),
    warmup=False,
    spike_reports=False,
    dispatcher_threads=1,
    torch_threads=1,
)


async def test_a_status_is_stamped_on_the_protocol_clock_not_the_engines_own() -> None:
    core = EngineCore(SETTINGS, Metrics(), loader=GatedLoader(), clock=ManualClock(5.0))
    await core.start()
    try:
        before = time.monotonic()
        published = core.status().published_at
        assert before <= published <= time.monotonic()
    finally:
        await core.stop()
