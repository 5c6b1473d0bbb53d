"""Every Prometheus instrument of steadyserve, defined once (docs/ARCHITECTURE.md §5: the
names are a contract). One `Metrics` per process (per app in tests, on its own registry, so
several coexist). Values are recorded where the decision is made: admission, request
outcomes and the HTTP edge in the front ends, queue, batches, pool and warm-up in the engine.

With several processes (`steadyserve serve` in engine-process mode) prometheus_client's
multiprocess mode is on: the supervisor sets `PROMETHEUS_MULTIPROC_DIR` before any child
starts, every process writes its values there, and /metrics renders them all, on any front
end and on the supervisor's probe port (`app/metrics_render.py`). Each gauge says how its
processes' values combine; the names stay the same.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.metrics_archive import MULTIPROCESS_DIR_ENV as MULTIPROCESS_DIR_ENV
from app.metrics_render import render_processes


def multiprocess_mode() -> bool:
    return bool(os.environ.get(MULTIPROCESS_DIR_ENV))


# From 1 ms to 10 s, dense around a 150 ms SLO so its quantiles interpolate well.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Up to the largest batch `max_batch_size` allows (1024): a larger batch fell in
# +Inf and read as 256 at every quantile.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Why a front end was replaced (`steadyserve_frontend_restarts`' reason).
FRONTEND_RESTART_REASONS = ("died", "hung")


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            "steadyserve_request_duration_seconds",
            "Admitted requests from their route to the engine's answer (tokenizing, token "
            "bucket and engine; not serialising), by model, task and outcome.",
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
            "Admitted until it left the queue, per input: for its batch, or expired, cancelled"
            " (client gone) or withdrawn with its failed request.",
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
        self.refusals_paused = Counter(
            "steadyserve_refusals_paused",
            "Refusals after which the front end paused reading their connection (admissions "
            "had not paid for answering them at once: api/refusal_budget.py).",
            registry=r,
        )
        self.write_stalls = Counter(
            "steadyserve_write_stalls",
            "Connections aborted: their client read nothing more of its answer for 30 s.",
            registry=r,
        )
        self.inflight = Gauge(
            "steadyserve_inflight_requests",
            "Admitted (let in from the headers) and not yet answered (all front ends).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_depth = Gauge(
            "steadyserve_queue_depth",
            "Inputs waiting for a batch, all models' (not prompts waiting for a KV slot).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_depth_max = Gauge(
            "steadyserve_queue_depth_max",
            "Deepest the queue has been over the last 30 s (twice a scrape interval).",
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
        # --- generation (task `generate`, engine) ------------------------------------------
        self.time_to_first_token = Histogram(
            "steadyserve_time_to_first_token_seconds",
            "Arrival in the engine to a sequence's first generated token, by model (one that"
            " ended before it, at its deadline or its client gone, is not observed).",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "steadyserve_time_per_output_token_seconds",
            "A finished sequence's mean time between its generated tokens (its first kept token"
            " to its last; EOS is not one), by model.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.output_tokens = Counter(
            "steadyserve_output_tokens",
            "Tokens generated (their rate is tokens/s), by model.",
            ["model"],
            registry=r,
        )
        self.prefix_reused_tokens = Counter(
            "steadyserve_generate_prefix_reused_tokens",
            "Prompt tokens a joining sequence found resident in its KV-cache slot and did not"
            " prefill (prefix reuse), by model.",
            ["model"],
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "steadyserve_kv_cache_usage_ratio",
            "Fraction of a generate model's KV-cache slots held by sequences.",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.sequences = Gauge(
            "steadyserve_sequences",
            "Sequences of a generate model, by state (running: holding a KV-cache slot; "
            "waiting: queued for one).",
            ["model", "state"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.engine_restarts = Counter(
            "steadyserve_engine_restarts",
            "Engine processes started to replace one that died (each counts itself).",
            registry=r,
        )
        # By why the front end it replaces ended: `died`, or `hung` (killed by the supervisor
        # for its silence: app/frontend_heartbeats.py). Both series exist at 0 from the start,
        # so that a first restart is an increase.
        self.frontend_restarts = Counter(
            "steadyserve_frontend_restarts",
            "Front-end processes started to replace one that died or hung (each counts itself),"
            " by why the one replaced ended.",
            ["reason"],
            registry=r,
        )
        for reason in FRONTEND_RESTART_REASONS:
            self.frontend_restarts.labels(reason)
        # --- telemetry and slow-request reports (docs/SPIKES.md) -------------------------
        self.slow_requests = Counter(
            "steadyserve_slow_requests",
            "Slow requests reported, by their top cause.",
            ["cause"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "steadyserve_event_loop_lag_seconds",
            "How late the event loop's ticker woke (10 ms in a front end, 5 ms in the engine), per "
            "tick, by process role.",
            ["process"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.loop_lag_max = Gauge(
            "steadyserve_event_loop_lag_seconds_max",
            "Longest event-loop lag over the last 30 s (twice a scrape interval), by process role.",
            ["process"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.gc_pause = Counter(
            "steadyserve_gc_pause_seconds",
            "Time spent in garbage collections, by process role and generation.",
            ["process", "generation"],
            registry=r,
        )
        self.gc_collections = Counter(
            "steadyserve_gc_collections",
            "Garbage collections, by process role and generation.",
            ["process", "generation"],
            registry=r,
        )
        self.process_cpu = Counter(
            "steadyserve_process_cpu_seconds",
            "CPU time used by steadyserve processes, by role.",
            ["process"],
            registry=r,
        )
        self.process_resident = Gauge(
            "steadyserve_process_resident_bytes",
            "Resident memory of steadyserve processes, by role (summed over live ones).",
            ["process"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.cgroup_throttled = Counter(
            "steadyserve_cgroup_throttled_seconds",
            "Time the container's cgroup was throttled by its CPU quota (as the engine saw it).",
            registry=r,
        )
        self.cgroup_throttled_periods = Counter(
            "steadyserve_cgroup_throttled_periods",
            "CFS periods in which the container's cgroup was throttled.",
            registry=r,
        )
        self.dispatcher_busy = Counter(
            "steadyserve_dispatcher_busy_seconds",
            "Wall time compute threads spent running batches and generation steps, failed ones"
            " and a failed batch's rows run alone included (divide by threads for use).",
            ["model"],
            registry=r,
        )
        self.unwarmed_shapes = Counter(
            "steadyserve_unwarmed_shapes",
            "Batches run at a shape warm-up had not covered (first time each, failed or not).",
            ["model"],
            registry=r,
        )
        # The GPU and CUDA allocator gauges are labelled by device: a gauge without labels
        # exists at 0 in every process that builds `Metrics()` (front ends, a CPU engine),
        # and the multiprocess min of that 0 and the engine's reading is 0 (a GPU clock
        # "under 1 GHz" on every replica). Labelled, a series exists once the engine sets it.
        self.gpu_sm_clock = Gauge(
            "steadyserve_gpu_sm_clock_hertz",
            "GPU SM clock (NVML).",
            ["gpu"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.gpu_temperature = Gauge(
            "steadyserve_gpu_temperature_celsius",
            "GPU temperature (NVML).",
            ["gpu"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.gpu_power = Gauge(
            "steadyserve_gpu_power_watts",
            "GPU power draw (NVML).",
            ["gpu"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.gpu_throttle_reasons = Gauge(
            "steadyserve_gpu_throttle_reasons",
            "NVML clock-throttle reason bits (0 = running at full clocks; docs/SPIKES.md).",
            ["gpu"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.gpu_memory_used = Gauge(
            "steadyserve_gpu_memory_used_bytes",
            "GPU memory in use, all processes (NVML).",
            ["gpu"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.gpu_memory_free = Gauge(
            "steadyserve_gpu_memory_free_bytes",
            "GPU memory free (NVML).",
            ["gpu"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.cuda_reserved = Gauge(
            "steadyserve_cuda_allocator_reserved_bytes",
            "Bytes the CUDA caching allocator holds from the device.",
            ["gpu"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.cuda_allocated = Gauge(
            "steadyserve_cuda_allocator_allocated_bytes",
            "Bytes of tensors allocated through the CUDA caching allocator.",
            ["gpu"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.cuda_largest_free_block = Gauge(
            "steadyserve_cuda_allocator_largest_free_block_bytes",
            "Largest free block inside the allocator's reserved segments (sampled each second).",
            ["gpu"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.cuda_alloc_retries = Counter(
            "steadyserve_cuda_alloc_retries",
            "cudaMalloc retries after the allocator flushed its cache (a device-wide stall).",
            registry=r,
        )
        self.cuda_context_changes = Counter(
            "steadyserve_cuda_context_changes",
            "Batches whose compute thread found a different CUDA context current.",
            registry=r,
        )

    def render(self) -> bytes:
        """The Prometheus text of this process, or of every process in multiprocess mode
        (`render_processes`). Any thread (/metrics runs it off the event loop)."""
        return render_processes() if multiprocess_mode() else generate_latest(self.registry)
