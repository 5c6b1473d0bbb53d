"""The one interface every probe has, the probes of one process together, and a fake.

A probe's `read()` returns a flat mapping of readings. A key ending in `_total` is a
cumulative counter: what matters for a request is its change between the request's start
and its end (`changes`). Any other key is a level (a clock, a temperature, bytes in use):
its value at the end is kept. Reads must be cheap (microseconds): a probe that reads a file
or a driver caches its last reading for a few milliseconds, or samples in the background.

Probes are read from their process's event loop thread (and counters such as GC pauses are
written from any thread under the GIL).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

Readings = dict[str, float]


class Probe(Protocol):
    def read(self) -> Mapping[str, float]:
        """Cumulative counters (`*_total`) and current levels; empty when unavailable."""
        ...


def is_counter(key: str) -> bool:
    return key.endswith("_total")


def changes(start: Mapping[str, float], end: Mapping[str, float]) -> Readings:
    """Each counter's increase from `start` to `end` (zero increases left out) and each
    level's value at `end`."""
    result: Readings = {}
    for key, value in end.items():
        if is_counter(key):
            increase = value - start.get(key, value)
            if increase > 0:
                result[key] = increase
        else:
            result[key] = value
    return result


class ProbeSet:
    """The probes of one process, read together. Event loop thread only."""

    def __init__(self, probes: Iterable[Probe]) -> None:
        self.probes = list(probes)

    def read(self) -> Readings:
        readings: Readings = {}
        for probe in self.probes:
            readings.update(probe.read())
        return readings


class Cached:
    """Wraps a reader that costs a system call: re-read at most every `max_age_s`, so a
    burst of requests shares one reading (a request's window is then known to within
    `max_age_s`, well under the tens of milliseconds a spike is made of)."""

    def __init__(
        self,
        reader: Callable[[], Mapping[str, float]],
        max_age_s: float = 0.005,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reader = reader
        self._max_age_s = max_age_s
        self._clock = clock
        self._value: Mapping[str, float] = {}
        self._read_at = float("-inf")

    def read(self) -> Mapping[str, float]:
        now = self._clock()
        if now - self._read_at >= self._max_age_s:
            self._value = self._reader()
            self._read_at = now
        return self._value


class FakeProbe:
    """A probe whose readings a test sets (GPU clocks, allocator retries, context changes
    on a machine without a GPU): `set(...)` replaces levels, `add(...)` bumps counters."""

    def __init__(self, readings: Mapping[str, float] | None = None) -> None:
        self.readings: Readings = dict(readings or {})

    def set(self, **levels: float) -> None:
        self.readings.update(levels)

    def add(self, **counters: float) -> None:
        for key, amount in counters.items():
            self.readings[key] = self.readings.get(key, 0.0) + amount

    def read(self) -> Mapping[str, float]:
        return dict(self.readings)
