"""Every Prometheus instrument of steadyserve, defined once (docs/ARCHITECTURE.md §5:
the names are a contract).

One `Metrics` per process (per app in tests, on its own registry, so several coexist).
Values are recorded where the decision is made: admission and request outcomes in the front
ends, queue, batches, pool and warm-up in the engine.

With several processes (`steadyserve serve` in engine-process mode) prometheus_client's
multiprocess mode is on: the supervisor sets `PROMETHEUS_MULTIPROC_DIR` before any child
starts, every process writes its values there, and any front end's /metrics renders them
all (`render`). Each gauge says how its processes' values combine; the names stay the same.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    return bool(os.environ.get(MULTIPROCESS_DIR_ENV))


# From 1 ms to 10 s, dense around a 150 ms SLO so its quantiles interpolate well.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            "steadyserve_request_duration_seconds",
            "Admission to response of admitted requests, by model, task and outcome.",
            ["model", "task", "outcome"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.admission_wait = Histogram(
            "steadyserve_admission_wait_seconds",
            "Time spent in admission (token bucket), admitted requests.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_wait = Histogram(
            "steadyserve_queue_wait_seconds",
            "Admitted until its batch starts, per input.",
            ["model", "bucket"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.batch_size = Histogram(
            "steadyserve_batch_size",
            "Inputs per executed batch (before padding).",
            ["model", "bucket"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.batch_compute = Histogram(
            "steadyserve_batch_compute_seconds",
            "Model time per batch, copies in and out included.",
            ["model", "bucket"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.rejected = Counter(
            "steadyserve_rejected_total",
            "Requests rejected, by model and reason.",
            ["model", "reason"],
            registry=r,
        )
        self.inflight = Gauge(
            "steadyserve_inflight_requests",
            "Admitted and not yet answered (all front ends).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_depth = Gauge(
            "steadyserve_queue_depth",
            "Inputs waiting for a batch.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_depth_max = Gauge(
            "steadyserve_queue_depth_max",
            "Deepest the queue has been over the last gauge refresh period (0.25 s).",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.pool_slots = Gauge(
            "steadyserve_pool_slots",
            "Buffer-pool slots, by length bucket and batch rows.",
            ["model", "bucket", "batch"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.pool_slots_in_use = Gauge(
            "steadyserve_pool_slots_in_use",
            "Buffer-pool slots held by a running batch.",
            ["model", "bucket", "batch"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.pool_acquire_wait = Histogram(
            "steadyserve_pool_acquire_wait_seconds",
            "Waiting for a free buffer-pool slot.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.pool_misses = Counter(
            "steadyserve_pool_misses_total",
            "Batches with no preallocated slot (served by a fallback allocation).",
            ["model"],
            registry=r,
        )
        self.pool_bytes = Gauge(
            "steadyserve_pool_bytes",
            "Bytes preallocated by the buffer pool.",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.warmup_shapes = Gauge(
            "steadyserve_warmup_shapes",
            "Shapes warm-up must run.",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.warmup_shapes_done = Gauge(
            "steadyserve_warmup_shapes_done",
            "Shapes warm-up has run.",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )

    def render(self) -> bytes:
        """The Prometheus text of this process, or of every process in multiprocess mode."""
        if multiprocess_mode():
            merged = CollectorRegistry()
            MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
            return generate_latest(merged)
        return generate_latest(self.registry)
