"""An engine stopped while it loads a model stops at once: the stop cancelled its start-up,
but the load ran on, on a compute thread, and the stop waited for it
(`Dispatcher.shutdown` waiting for its threads, then the interpreter's exit joining them),
the engine's loop blocked, until its supervisor's stop deadline killed it. A load that
blocks until the test ends (`tests/support/blocking_load.py`) over the stand-in model."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
from functools import partial
from pathlib import Path

from app.engine.core import EngineCore
from app.engine.process import run_engine_process
from app.engine.zmq_client import EngineAddresses
from app.metrics import Metrics
from tests.support.blocking_load import BlockingLoader, blocking_core
from tests.support.stand_in_engine import stand_in_settings

SETTINGS = stand_in_settings("a")
# Only what ends a test that fails (the stop waited for the load): not a timing.
RELEASE_ANYWAY_S = 10.0


async def test_a_core_stopped_while_loading_does_not_wait_for_the_load() -> None:
    entered, release = threading.Event(), threading.Event()
    loader = BlockingLoader(entered, release)
    core = EngineCore(SETTINGS, Metrics(), loader=loader)
    startup = asyncio.create_task(core.start())
    # The old stop blocked the event loop until the load returned: released from a thread.
    safety = threading.Timer(RELEASE_ANYWAY_S, release.set)
    safety.start()
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        startup.cancel()
        await asyncio.gather(startup, return_exceptions=True)
        await core.stop()
        assert not loader.returned, "the stop waited for the load to end"
        assert not core.ready
    finally:
        release.set()
        safety.cancel()


def test_an_engine_process_stopped_while_loading_exits_0_at_once(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    entered = context.Event()
    addresses = EngineAddresses.in_directory(tmp_path)
    make_core = partial(blocking_core, entered)
    engine = context.Process(
        target=run_engine_process, args=(SETTINGS, addresses, os.getpid(), False, make_core)
    )
    engine.start()
    try:
        assert entered.wait(60), "the engine never started loading"
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGUSR1)  # its supervisor's stop
        # Its load never returns: an engine that waited for it never exits.
        engine.join(60)
        assert engine.exitcode == 0
    finally:
        if engine.is_alive():
            engine.kill()
            engine.join()
