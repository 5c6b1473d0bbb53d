"""The runner's time: the `Clock` it takes by injection, `MonotonicClock` for real runs and
`LoopClock` (the event loop's own time) for tests that drive a run in virtual time. Called
from the run's event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds, and a way to wait for a moment on that scale."""

    def now(self) -> float: ...

    async def sleep_until(self, deadline: float) -> None: ...


class MonotonicClock:
    """The default: ``time.monotonic`` (nanosecond resolution) and asyncio timers to wait.

    Not the loop's own clock: uvloop's ``loop.time()`` is libuv's millisecond clock, cached
    per loop iteration, which would round every latency to whole milliseconds. Timers still
    fire with about a millisecond of granularity; a send that is late by it counts the
    lateness in its latency (the conservative side), and the report shows the dispatch lag.
    """

    def now(self) -> float:
        return time.monotonic()

    async def sleep_until(self, deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


class LoopClock:
    """The running event loop's clock; under a loop with virtual time (the tests), virtual."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep_until(self, deadline: float) -> None:
        delay = deadline - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)
