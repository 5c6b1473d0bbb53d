"""Garbage-collector pauses by generation, from `gc.callbacks`: every collection is timed
(start to stop, on whichever thread triggered it) and added to its generation's total.

`install()` once per process; reads are free (counters in memory).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping
from typing import Any

GENERATIONS = (0, 1, 2)


class GcPauseProbe:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.pause_s_total = [0.0, 0.0, 0.0]
        self.collections_total = [0, 0, 0]
        self.longest_s = [0.0, 0.0, 0.0]
        self._started: float | None = None
        self.on_pause: Callable[[int, float], None] = lambda generation, seconds: None

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        if self._started is None:
            return
        self.record(int(info.get("generation", 0)), self._clock() - self._started)
        self._started = None

    def record(self, generation: int, seconds: float) -> None:
        self.pause_s_total[generation] += seconds
        self.collections_total[generation] += 1
        self.longest_s[generation] = max(self.longest_s[generation], seconds)
        self.on_pause(generation, seconds)

    def read(self) -> Mapping[str, float]:
        readings: dict[str, float] = {}
        for generation in GENERATIONS:
            readings[f"gc_gen{generation}_pause_seconds_total"] = self.pause_s_total[generation]
            readings[f"gc_gen{generation}_collections_total"] = self.collections_total[generation]
        return readings
