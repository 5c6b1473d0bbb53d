"""One process's telemetry: its probes (read together for per-request reports), its
event-loop lag monitor, and the metrics they feed (docs/ARCHITECTURE.md §5).

A front end and the engine each have one (`role` "frontend" or "engine"). Probes whose
readings are slow (NVML, the CUDA allocator's snapshot: `background.py`) are sampled on the
process's sampler thread, started, stopped and joined with it; the rest are read on the
loop, which reads only published samples of the former. The loop monitor's ticker
publishes the probes' metrics every `PUBLISH_EVERY_S`; with the engine in the front end's
process (`STEADY_ENGINE=inprocess`) the engine's telemetry leaves the process-wide probes
(GC, CPU, cgroup, the shared loop) to the front end's, so nothing counts twice.

Create, start and stop on the process's event loop thread.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping

from app.metrics import Metrics
from app.telemetry.background import BackgroundProbe, ProbeSampler
from app.telemetry.cpu import CpuProbe
from app.telemetry.gc_pauses import GENERATIONS, GcPauseProbe
from app.telemetry.loop_lag import LoopLagMonitor
from app.telemetry.probe import Cached, Probe, ProbeSet, Readings, is_counter
from app.telemetry.recent_max import RecentMax
from app.telemetry.throttling import CgroupThrottleProbe

PUBLISH_EVERY_S = 0.25
# A tick's readings stand for "now" for this long (two ticks of the 10 ms loop monitor).
SNAPSHOT_FRESH_S = 0.02
# A fresh read stands for "now" this long (reads of the same loop turn: see `read`).
READ_SHARED_S = 0.001


def process_wide_probes() -> tuple[LoopLagMonitor, GcPauseProbe, list[Probe]]:
    """The probes every process has: its loop, its GC, its CPU and its cgroup."""
    return LoopLagMonitor(), GcPauseProbe(), [CpuProbe(), CgroupThrottleProbe()]


class ProcessTelemetry:
    def __init__(
        self,
        role: str,
        metrics: Metrics,
        probes: Iterable[Probe] = (),
        loop: LoopLagMonitor | None = None,
        gc: GcPauseProbe | None = None,
        publishes_container: bool = True,
        own_ticker: bool = True,
        clock: Callable[[], float] = time.monotonic,
        gpu: str | None = None,
    ) -> None:
        """`publishes_container`: this process counts the container-wide figures (cgroup
        throttling) in the metrics; exactly one process of a server should. `own_ticker`
        False: the process's periodic task ticks the loop monitor through `sleep`. `gpu`:
        the device index the GPU and CUDA allocator gauges are labelled with (the engine's,
        on CUDA); None sets none of them."""
        self.role = role
        self.gpu = gpu
        self.own_ticker = own_ticker
        self._running = False
        self.publishes_container = publishes_container
        self.metrics = metrics
        self.loop = loop
        self.gc = gc
        listed: list[Probe] = [p for p in (loop, gc) if p is not None]
        self.probes = ProbeSet([*listed, *probes])
        self.sampler = ProbeSampler(p for p in self.probes.probes if isinstance(p, BackgroundProbe))
        self._published: Readings = {}
        self._levels_set: set[str] = set()  # level gauges given a value (`_set_levels`)
        self._latest: Readings = {}
        self._latest_at = 0.0
        self._clock = clock
        self._recent_lag_high = RecentMax()
        self._shared_read = Cached(self.probes.read, READ_SHARED_S, clock)
        self._next_publish = 0.0
        if loop is not None:
            histogram = metrics.loop_lag.labels(role)
            loop.on_tick = lambda lag: self._on_tick(histogram.observe, lag)

    @classmethod
    def for_process(
        cls,
        role: str,
        metrics: Metrics,
        extra: Iterable[Probe] = (),
        publishes_container: bool = True,
        own_ticker: bool = True,
        gpu: str | None = None,
    ) -> ProcessTelemetry:
        loop, gc, probes = process_wide_probes()
        return cls(
            role, metrics, [*probes, *extra], loop, gc, publishes_container, own_ticker, gpu=gpu
        )

    def start(self) -> None:
        # Counters are published by their increase from here on (a restarted process does
        # not count the cgroup's whole history again).
        self._published = dict(self.probes.read())
        if self.gc is not None:
            self.gc.install()
        if self.loop is not None and self.own_ticker:
            self.loop.start()
        self.sampler.start()
        self._running = True

    async def stop(self) -> None:
        """Stop the probes, and wait (bounded) for the sampler thread to end: left running,
        a sample calling NVML while the interpreter shuts down can crash the process on its
        way out. Loop thread only."""
        self._running = False
        self.sampler.stop()
        if self.gc is not None:
            self.gc.uninstall()
        if self.loop is not None:
            await self.loop.stop()
        if self.sampler.running:
            await asyncio.to_thread(self.sampler.join)  # its sample may take a while

    async def sleep(self, seconds: float) -> None:
        """For the process's one periodic task (the engine's status publisher): sleeps, and
        while this telemetry runs without a ticker of its own, times the wake-up as the
        loop monitor's tick. Loop thread only."""
        if self._running and self.loop is not None and not self.own_ticker:
            await self.loop.sleep(seconds)
        else:
            await asyncio.sleep(seconds)

    def read(self) -> Readings:
        """Every probe now. Callers within `READ_SHARED_S` of a read share it: slow requests
        that finish in one event-loop turn (under overload, dozens at once) read the probes
        once, not once each."""
        return dict(self._shared_read.read())

    def snapshot(self) -> Readings:
        """The readings of the loop monitor's last tick while that is at most
        `SNAPSHOT_FRESH_S` old, so a request can note where the probes stood without
        reading them itself (reading every probe per request cost ~5 % of throughput);
        read afresh otherwise (no tick yet, or the loop was held up since the last one,
        when whatever held it must not be counted against the next request)."""
        if self._latest and self._clock() - self._latest_at <= SNAPSHOT_FRESH_S:
            return self._latest
        return self.read()

    def _on_tick(self, observe: object, lag: float) -> None:
        observe(lag)  # type: ignore[operator]
        self._latest = self.read()
        now = self._latest_at = self._clock()
        if now >= self._next_publish:
            self._next_publish = now + PUBLISH_EVERY_S
            self.publish()

    def publish(self) -> None:
        """Bring this process's probe metrics up to date (counters by their increase since
        the previous call, levels by their value)."""
        m, role = self.metrics, self.role
        readings = self.probes.read()
        increases = {
            key: value - self._published.get(key, 0.0)
            for key, value in readings.items()
            if is_counter(key)
        }
        # Kept, not replaced: a counter missing from one reading (a cgroup file that could
        # not be read) must not count its whole history again when it is back.
        self._published.update(readings)

        def bump(key: str, counter: object) -> None:
            amount = increases.get(key, 0.0)
            if amount > 0:
                counter.inc(amount)  # type: ignore[attr-defined]

        for generation in GENERATIONS:
            g = str(generation)
            bump(f"gc_gen{g}_pause_seconds_total", m.gc_pause.labels(role, g))
            bump(f"gc_gen{g}_collections_total", m.gc_collections.labels(role, g))
        bump("process_cpu_seconds_total", m.process_cpu.labels(role))
        if self.publishes_container:
            bump("cgroup_throttled_seconds_total", m.cgroup_throttled)
            bump("cgroup_throttled_periods_total", m.cgroup_throttled_periods)
        bump("cuda_alloc_retries_total", m.cuda_alloc_retries)
        bump("cuda_context_changes_total", m.cuda_context_changes)
        self._set_levels(readings)
        if self.loop is not None:
            longest = self._recent_lag_high.roll(self._clock(), self.loop.take_high_water())
            m.loop_lag_max.labels(role).set(longest)

    def _set_levels(self, readings: Mapping[str, float]) -> None:
        m = self.metrics
        gauges = {"process_resident_bytes": m.process_resident.labels(self.role)}
        if self.gpu is not None:
            device = {
                "gpu_sm_clock_hertz": m.gpu_sm_clock,
                "gpu_temperature_celsius": m.gpu_temperature,
                "gpu_power_watts": m.gpu_power,
                "gpu_throttle_reasons": m.gpu_throttle_reasons,
                "gpu_memory_used_bytes": m.gpu_memory_used,
                "gpu_memory_free_bytes": m.gpu_memory_free,
                "cuda_reserved_bytes": m.cuda_reserved,
                "cuda_allocated_bytes": m.cuda_allocated,
                "cuda_largest_free_block_bytes": m.cuda_largest_free_block,
            }
            gauges |= {key: gauge.labels(self.gpu) for key, gauge in device.items()}
        for key, gauge in gauges.items():
            if key in readings:
                gauge.set(readings[key])
                self._levels_set.add(key)
            elif key in self._levels_set:
                # Its probe stopped reading (NVML lost the GPU): NaN, not the last healthy
                # value shown as current (a multiprocess gauge cannot be removed).
                gauge.set(math.nan)
                self._levels_set.discard(key)
