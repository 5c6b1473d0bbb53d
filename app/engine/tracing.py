"""The engine's side of slow-request reports (docs/SPIKES.md): a `RequestTracer` that notes
where the engine's probes stood when a request was queued, and how many of the shared
compute slots were running a batch then, and, when its last output goes, builds its
`EngineTrace` (queue depth and busy slots at arrival, its batch, each probe's change).

A request that spent less than `min_engine_s` in the engine gets no trace: it cannot have
been made slow here (the front end's threshold is at least twice that), and building,
encoding and decoding a trace for every request cost the engine's event loop ~8 us each,
time the compute threads then wait for the GIL. Event loop thread only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

from app.compute_slots import ComputeSlots
from app.engine.protocol import BatchTrace, EngineTrace
from app.telemetry.probe import Readings, changes
from app.telemetry.sampler import ProcessTelemetry


class _Arrival(NamedTuple):
    queue_depth: int  # inputs queued ahead of the request when it arrived
    readings: Readings
    at: float
    busy_slots: int  # compute slots running a batch (of any model) when it arrived


class ProbeTracer:
    def __init__(
        self,
        telemetry: ProcessTelemetry,
        clock: Callable[[], float],
        min_engine_s: float,
        slots: ComputeSlots | None = None,
    ) -> None:
        """`slots`: the compute slots every model shares, whose busy count at a request's
        arrival its trace carries (a request queued behind no input of its own model
        waited for another model's batch)."""
        self._telemetry = telemetry
        self._clock = clock
        self.min_engine_s = min_engine_s
        self._slots = slots
        self._pid = os.getpid()

    def arrive(self, queue_depth: int) -> object | None:
        # As of the last tick (at most ~20 ms old), like the front end's.
        busy = self._slots.capacity - self._slots.free if self._slots is not None else 0
        return _Arrival(queue_depth, self._telemetry.snapshot(), self._clock(), busy)

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
            busy_compute_slots_at_arrival=arrival.busy_slots,
            compute_slots=self._slots.capacity if self._slots is not None else 0,
        )


class NoTraces:
    """While slow-request reports are off: nothing is read."""

    def arrive(self, queue_depth: int) -> object | None:
        return None

    def finish(self, arrival: object | None, batch: BatchTrace | None) -> EngineTrace | None:
        return None


NO_TRACES = NoTraces()
