"""The engine's request tracer: a trace (queue depth at arrival, probe changes) only for a
request that spent long enough in the engine to be made slow there."""

from __future__ import annotations

from app.compute_slots import ComputeSlots
from app.engine.tracing import ProbeTracer
from app.metrics import Metrics
from app.telemetry.probe import FakeProbe
from app.telemetry.sampler import ProcessTelemetry


def test_a_request_quick_in_the_engine_gets_no_trace_and_a_long_one_its_changes() -> None:
    now = [0.0]
    device = FakeProbe({"cuda_alloc_retries_total": 0.0, "gpu_sm_clock_hertz": 1.9e9})
    telemetry = ProcessTelemetry("engine", Metrics(), [device], clock=lambda: now[0])
    tracer = ProbeTracer(telemetry, lambda: now[0], min_engine_s=0.05)

    quick = tracer.arrive(queue_depth=3)
    now[0] = 0.049
    assert tracer.finish(quick, None) is None

    long = tracer.arrive(queue_depth=7)
    device.add(cuda_alloc_retries_total=2)
    device.set(gpu_sm_clock_hertz=810e6)
    now[0] = 0.2
    trace = tracer.finish(long, None)
    assert trace is not None
    assert trace.queue_depth_at_arrival == 7
    assert trace.probes["cuda_alloc_retries_total"] == 2
    assert trace.probes["gpu_sm_clock_hertz"] == 810e6


def test_a_trace_carries_the_compute_slots_busy_when_the_request_arrived() -> None:
    """A request queued behind no input of its own model waited for another model's batch
    on the shared compute slots: its report said "behind 0 inputs" and nothing else."""
    now = [0.0]
    telemetry = ProcessTelemetry("engine", Metrics(), [], clock=lambda: now[0])
    slots = ComputeSlots(2)
    slots.take("another model")
    tracer = ProbeTracer(telemetry, lambda: now[0], min_engine_s=0.05, slots=slots)
    arrival = tracer.arrive(queue_depth=0)
    slots.give()  # its batch ended before this request's trace was built
    now[0] = 0.2
    trace = tracer.finish(arrival, None)
    assert trace is not None
    assert (trace.busy_compute_slots_at_arrival, trace.compute_slots) == (1, 2)
