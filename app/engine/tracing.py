"""The engine's side of slow-request reports (docs/SPIKES.md): a `RequestTracer` that notes
where the engine's probes stood when a request was queued and, when its last output goes,
builds its `EngineTrace` (queue depth at arrival, its batch, each probe's change).

A request that spent less than `min_engine_s` in the engine gets no trace: it cannot have
been made slow here (the front end's threshold is at least twice that), and building,
encoding and decoding a trace for every request cost the engine's event loop ~8 us each,
time the compute threads then wait for the GIL. Event loop thread only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

from app.engine.protocol import BatchTrace, EngineTrace
from app.telemetry.probe import Readings, changes
from app.telemetry.sampler import ProcessTelemetry


class _Arrival(NamedTuple):
    queue_depth: int  # inputs queued ahead of the request when it arrived
    readings: Readings
    at: float


class ProbeTracer:
    def __init__(
        self, telemetry: ProcessTelemetry, clock: Callable[[], float], min_engine_s: float
    ) -> None:
        self._telemetry = telemetry
        self._clock = clock
        self.min_engine_s = min_engine_s
        self._pid = os.getpid()

    def arrive(self, queue_depth: int) -> object | None:
        # As of the last tick (at most ~20 ms old), like the front end's.
        return _Arrival(queue_depth, self._telemetry.snapshot(), self._clock())

    def finish(self, arrival: object | None, batch: BatchTrace | None) -> EngineTrace | None:
        if not isinstance(arrival, _Arrival):
            return None
        if self._clock() - arrival.at < self.min_engine_s:
            return None
        return EngineTrace(
            pid=self._pid,
            queue_depth_at_arrival=arrival.queue_depth,
            batch=batch,
            probes=changes(arrival.readings, self._telemetry.read()),
        )


class NoTraces:
    """While slow-request reports are off: nothing is read."""

    def arrive(self, queue_depth: int) -> object | None:
        return None

    def finish(self, arrival: object | None, batch: BatchTrace | None) -> EngineTrace | None:
        return None


NO_TRACES = NoTraces()
