"""How far behind a front end's event loop runs: the wait a new request meets before any
of its code runs.

A request's wait is not only the engine's queue: under a flood it first waits for the front
end's event loop to get to it (reading, parsing, every other connection's turn). That wait
is invisible to the engine's backlog, so admission adds it: a timer that should fire every
`interval_s` measures how late it fires. `LagTracker` (pure, injected clock) keeps a peak
that fades, so one late tick counts for a while and a calm loop soon reads zero.

`LoopLagMonitor` runs on the event loop it measures; read `seconds` from that thread only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class LagTracker:
    """A fading peak of observed lateness: the largest recent value, falling linearly to
    zero over `window_s` unless a larger one replaces it (a calm loop reads exactly 0)."""

    def __init__(self, window_s: float = 0.25) -> None:
        self._window_s = window_s
        self._peak = 0.0
        self._at = 0.0

    def record(self, lateness_s: float, now: float) -> None:
        if lateness_s >= self.current(now):
            self._peak, self._at = lateness_s, now

    def current(self, now: float) -> float:
        faded = 1.0 - max(0.0, now - self._at) / self._window_s
        return self._peak * faded if faded > 0 else 0.0


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
