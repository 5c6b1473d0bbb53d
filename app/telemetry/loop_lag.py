"""Event-loop lag: how late a ticker on the loop wakes up, split into the part where the
loop's thread was runnable but waiting for a CPU (it was *starved* by other threads or
processes: `schedstat.py`) and the rest, where code on the loop held it up (it was
*blocked*).

One `LoopLagMonitor` per event loop; start and stop it on that loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping

from app.telemetry.schedstat import thread_runqueue_wait_s

TICK_S = 0.01


class LoopLagMonitor:
    def __init__(
        self,
        tick_s: float = TICK_S,
        clock: Callable[[], float] = time.monotonic,
        thread_wait: Callable[[], float] = thread_runqueue_wait_s,
    ) -> None:
        self.tick_s = tick_s
        self._clock = clock
        self._thread_wait = thread_wait
        self.lag_s_total = 0.0
        self.busy_lag_s_total = 0.0  # lag not explained by waiting for a CPU
        self._high_water_s = 0.0
        self._due_at: float | None = None
        self._waited_before: float | None = None
        self._task: asyncio.Task[None] | None = None
        self.on_tick: Callable[[float], None] = lambda lag_s: None

    def start(self) -> None:
        """Tick on a task of the monitor's own. A process that already runs a periodic task
        on its loop ticks the monitor with that task's `sleep` instead (and does not call
        this): every wake-up of an idle loop costs ~50 us of CPU here, 5 ms of CPU a second
        at a 10 ms tick, and under load it takes the GIL from the compute threads."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="loop-lag-monitor"
            )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await self.sleep(self.tick_s)

    async def sleep(self, seconds: float) -> None:
        """`asyncio.sleep(seconds)`, its wake-up timed as a tick. Only one task per loop may
        tick the monitor (its own, or the process's periodic task); loop thread only."""
        if self._waited_before is None:
            self._waited_before = self._thread_wait()
        started = self._clock()
        self._due_at = started + seconds
        await asyncio.sleep(seconds)
        # One schedstat read per tick: a tick's end reading is the next tick's start.
        woke, waited = self._clock(), self._thread_wait()
        self.record(started, woke, waited - self._waited_before, seconds)
        self._waited_before = waited

    def record(
        self, started: float, woke: float, runqueue_wait_s: float, slept_s: float | None = None
    ) -> None:
        """One tick: asked to sleep `slept_s` (the tick) from `started`, woke at `woke`, and
        the loop's thread spent `runqueue_wait_s` of that runnable but off a CPU."""
        lag = max(0.0, woke - started - (self.tick_s if slept_s is None else slept_s))
        busy = lag - min(lag, max(0.0, runqueue_wait_s))
        self.lag_s_total += lag
        self.busy_lag_s_total += busy
        self._high_water_s = max(self._high_water_s, lag)
        self._due_at = None
        self.on_tick(lag)

    def _pending(self) -> float:
        """Lag of the tick that is overdue now (a reading taken right after a blocking call,
        before the ticker had its turn, must still see it)."""
        if self._due_at is None:
            return 0.0
        return max(0.0, self._clock() - self._due_at)

    def take_high_water(self) -> float:
        """The longest lag since the previous call, then reset."""
        high, self._high_water_s = max(self._high_water_s, self._pending()), 0.0
        return high

    def read(self) -> Mapping[str, float]:
        pending = self._pending()
        # A pending lag is counted as busy: the reader runs on the loop's thread, so the
        # overdue tick was held up by code running there, as far as anyone can tell yet.
        return {
            "loop_lag_seconds_total": self.lag_s_total + pending,
            "loop_busy_lag_seconds_total": self.busy_lag_s_total + pending,
        }
