"""How far behind a front end's event loop runs: the wait a new request meets before any
of its code runs.

A request's wait is not only the engine's queue: under a flood it first waits for the front
end's event loop to get to it (reading, parsing, every other connection's turn). That wait
is invisible to the engine's backlog, so admission adds it: a timer that should fire every
`interval_s` measures how late it fires. `LagTracker` (pure, injected clock) averages the
lateness of the recent ticks.

`LoopLagMonitor` runs on the event loop it measures; read `seconds` from that thread only.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable


class LagTracker:
    """The mean lateness of the ticks of the last `window_s`: what a request arriving now
    can expect to wait for the loop. A lone stall (a collection, a descheduled moment) is
    one late tick among many and barely moves it; a loop kept busy by a flood is late on
    every tick. Reads exactly 0 once no late tick is left in the window."""

    def __init__(self, window_s: float = 0.25) -> None:
        self._window_s = window_s
        self._ticks: deque[tuple[float, float]] = deque()  # (when, lateness)
        self._total = 0.0

    def record(self, lateness_s: float, now: float) -> None:
        self._ticks.append((now, lateness_s))
        self._total += lateness_s
        self._forget_before(now - self._window_s)

    def current(self, now: float) -> float:
        self._forget_before(now - self._window_s)
        if not self._ticks or self._total <= 0:
            return 0.0
        return self._total / len(self._ticks)

    def _forget_before(self, start: float) -> None:
        while self._ticks and self._ticks[0][0] < start:
            self._total -= self._ticks.popleft()[1]
        if not self._ticks:
            self._total = 0.0  # no float residue once the window is empty


# Timers fire up to about a millisecond late on a calm loop (uvloop's clock has millisecond
# resolution): lateness below this is noise, not waiting.
NOISE_FLOOR_S = 0.002


class LoopLagMonitor:
    def __init__(
        self, interval_s: float = 0.005, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._tracker = LagTracker()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._tick(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def seconds(self) -> float:
        return self._tracker.current(self._clock())

    async def _tick(self) -> None:
        while True:
            expected = self._clock() + self._interval_s
            await asyncio.sleep(self._interval_s)  # the measurement itself: how late it wakes
            now = self._clock()
            self._tracker.record(max(0.0, now - expected - NOISE_FLOOR_S), now)
