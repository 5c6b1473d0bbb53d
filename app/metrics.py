"""Every Prometheus instrument of steadyserve, defined once (docs/ARCHITECTURE.md §5:
the names are a contract).

One `Metrics` per app, on its own registry, so that several apps (tests) can coexist in one
process. Values are recorded where the decision is made (admission, batcher, pool, warm-up).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
            "steadyserve_inflight_requests", "Admitted and not yet answered.", registry=r
        )
        self.queue_depth = Gauge(
            "steadyserve_queue_depth", "Inputs waiting for a batch.", registry=r
        )
        self.queue_depth_max = Gauge(
            "steadyserve_queue_depth_max",
            "Deepest the queue has been since the previous scrape.",
            registry=r,
        )
        self.pool_slots = Gauge(
            "steadyserve_pool_slots",
            "Buffer-pool slots, by length bucket and batch rows.",
            ["model", "bucket", "batch"],
            registry=r,
        )
        self.pool_slots_in_use = Gauge(
            "steadyserve_pool_slots_in_use",
            "Buffer-pool slots held by a running batch.",
            ["model", "bucket", "batch"],
            registry=r,
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
        )
        self.warmup_shapes = Gauge(
            "steadyserve_warmup_shapes", "Shapes warm-up must run.", ["model"], registry=r
        )
        self.warmup_shapes_done = Gauge(
            "steadyserve_warmup_shapes_done", "Shapes warm-up has run.", ["model"], registry=r
        )
