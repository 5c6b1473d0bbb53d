"""The engine: load -> warm up -> ready; admit by predicted delay -> batch -> stream outputs.

`EngineCore` owns the models, their buffer pools and batchers, the dispatcher's threads and
the compute slots they share. It speaks only the messages of `protocol.py`: `submit` takes a
`Submit` and answers through `emit` (a stream of `Output`, or one `Failure`), whoever carries
them (`process.py` over ZeroMQ, `inprocess.py` by direct call).

Construct and call from the engine's event loop thread only; model loading and all compute
run on the dispatcher's threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from app.admission import DelayEstimate, Rejected, RejectReason, delay_verdict
from app.batcher import ComputeSlots, ItemResult, ModelBatcher
from app.dispatcher import Dispatcher, plan_threads
from app.engine.health import BatchHealth
from app.engine.loading import load_models
from app.engine.protocol import (
    BatchTrace,
    EmbedOutput,
    EngineStatus,
    EngineTrace,
    Failure,
    FailureKind,
    FromEngine,
    ModelInfo,
    Output,
    Submit,
)
from app.engine.reports import config_report, pool_report
from app.failures import BatchFailed, DeadlineExceeded
from app.metrics import Metrics
from app.models.base import resolve_device
from app.scheduler import BatchShape
from app.settings import Settings, export_cuda_alloc_conf
from app.startup import RunnerLoader, freeze_startup_heap, load_runner
from app.telemetry.cgroup import available_cpus
from app.telemetry.cuda import CudaAllocatorProbe, CudaContextProbe
from app.telemetry.gpu import NvmlProbe
from app.telemetry.probe import Probe, Readings, changes
from app.telemetry.sampler import ProcessTelemetry

log = logging.getLogger(__name__)

Emit = Callable[[FromEngine], None]
RequestKey = tuple[bytes, int]  # (front end, its request id): ids are unique per front end


class _Arrival(NamedTuple):
    queue_depth: int  # inputs queued ahead of the request when it arrived
    readings: Readings


class EngineCore:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        loader: RunnerLoader = load_runner,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.engine_id = uuid.uuid4().hex[:12]
        self._loader = loader
        self._clock = clock
        self.device = resolve_device(settings.device)
        self._cuda_alloc_conf: str | None = None
        if self.device.type == "cuda":
            # CUDA reads the allocator configuration once, when it initialises: set the
            # default before anything (the compute threads' streams included) touches it.
            self._cuda_alloc_conf = export_cuda_alloc_conf(settings)
        self.dispatcher = Dispatcher(
            plan_threads(
                compute_threads=settings.dispatcher_threads,
                torch_threads=settings.torch_threads,
                torch_interop_threads=settings.torch_interop_threads,
                cpus=available_cpus(),
            ),
            self.device,
        )
        self.slots = ComputeSlots(self.dispatcher.capacity)
        self.health = BatchHealth(settings.unhealthy_after_failed_batches)
        self.batchers: dict[str, ModelBatcher] = {}
        self._requests: dict[RequestKey, asyncio.Task[None]] = {}
        self._warmup_done = 0
        self._warmup_total = 0
        self._ready = False
        self._startup_error: str | None = None
        self._queue_high_water = 0
        self.cuda_context = CudaContextProbe(enabled=self.device.type == "cuda")
        self.telemetry = self._telemetry()

    def _telemetry(self) -> ProcessTelemetry:
        """The engine's probes (docs/SPIKES.md). In-process, the front end's telemetry
        already watches this process and its loop: only the device's probes are added."""
        index = (self.device.index or 0) if self.device.type == "cuda" else None
        device_probes: list[Probe] = [
            CudaAllocatorProbe(index),
            self.cuda_context,
            NvmlProbe(index),
        ]
        if self.settings.engine == "inprocess":
            return ProcessTelemetry("engine", self.metrics, device_probes)
        return ProcessTelemetry.for_process("engine", self.metrics, device_probes)

    # --- start-up -----------------------------------------------------------------------
    async def start(self) -> None:
        """Load every model, preallocate its buffers, warm up every shape, then be ready.
        A failure is kept for the status (and so /readyz and /healthz), not raised."""
        if self.settings.spike_reports:
            self.telemetry.start()
        try:
            await self._start()
        except Exception as error:
            log.exception("engine start-up failed")
            self._startup_error = f"start-up failed: {type(error).__name__}"

    async def _start(self) -> None:
        started = time.perf_counter()
        loaded = await load_models(
            self.settings,
            self.dispatcher,
            self.device,
            self._loader,
            self._cuda_alloc_conf,
            self.metrics,
        )
        for name, model in loaded.items():
            warmup_shapes = len(model.policy.shapes()) if self.settings.warmup else 0
            self.batchers[name] = ModelBatcher(
                model.runner,
                model.policy,
                model.pool,
                self.dispatcher,
                self.slots,
                self.metrics,
                self._clock,
                self.health.record,
                before_batch=self.cuda_context.check_thread,
            )
            self._warmup_total += warmup_shapes
            self.metrics.warmup_shapes.labels(name).set(warmup_shapes)
        for name, batcher in self.batchers.items():
            if self.settings.warmup:
                await self._warm_up(name, batcher)
            batcher.start()
        freeze_startup_heap()
        self._ready = True
        log.info(
            "engine ready in %.1f s (%d shapes warmed up)",
            time.perf_counter() - started,
            self._warmup_done,
        )

    async def _warm_up(self, name: str, batcher: ModelBatcher) -> None:
        started = time.perf_counter()
        gauge = self.metrics.warmup_shapes_done.labels(name)

        def shape_done(done: int, total: int) -> None:
            self._warmup_done += 1
            gauge.set(done)
            if done == total or done % 5 == 0:
                log.info(
                    "%s: warm-up %d/%d shapes (%.1f s)",
                    name,
                    done,
                    total,
                    time.perf_counter() - started,
                )

        await batcher.warm_up(batcher.runner.pad_token_id + 1, shape_done)

    @property
    def ready(self) -> bool:
        return self._ready

    # --- status -------------------------------------------------------------------------
    def backlog_seconds(self) -> float:
        """Queued work of every model, divided among the compute threads they share."""
        total = sum(b.scheduler.backlog_seconds() for b in self.batchers.values())
        return total / self.slots.capacity

    def queued_inputs(self) -> int:
        return sum(b.scheduler.depth for b in self.batchers.values())

    def status(self) -> EngineStatus:
        """What front ends shed load and answer probes from."""
        if self._startup_error is not None:
            state = "failed"
        elif not self.batchers:
            state = "loading"
        elif not self._ready:
            state = "warming_up"
        else:
            state = "ready"
        per_input = [
            b.scheduler.seconds_per_input(b.scheduler.policy.length_buckets[0])
            for b in self.batchers.values()
        ]
        healthy = self._startup_error is None and self.health.healthy
        return EngineStatus(
            engine_id=self.engine_id,
            pid=os.getpid(),
            state=state,
            warmup_done=self._warmup_done,
            warmup_total=self._warmup_total,
            healthy=healthy,
            backlog_s=self.backlog_seconds(),
            seconds_per_input=min(per_input, default=0.0) / self.slots.capacity,
            queued_inputs=self.queued_inputs(),
            published_at=self._clock(),
            models={
                name: ModelInfo(
                    task=b.runner.task,
                    output_width=b.runner.output_width,
                    max_input_tokens=b.runner.max_input_tokens,
                )
                for name, b in self.batchers.items()
            },
            problem=self._startup_error or self.health.problem,
        )

    def refresh_gauges(self) -> None:
        """Engine-side gauges (queue depth and its high-water mark since the previous call,
        pool slots); called periodically, or before a scrape in-process."""
        m = self.metrics
        m.queue_depth.set(self.queued_inputs())
        high, self._queue_high_water = self._queue_high_water, self.queued_inputs()
        m.queue_depth_max.set(high)
        if self.settings.spike_reports:
            self.telemetry.publish()
        for name, batcher in self.batchers.items():
            stats = batcher.pool.stats()
            for shape, total in stats.slots.items():
                labels = (name, str(shape.length), str(shape.batch))
                m.pool_slots.labels(*labels).set(total)
                m.pool_slots_in_use.labels(*labels).set(stats.in_use[shape])

    # --- requests -----------------------------------------------------------------------
    def submit(self, origin: bytes, request: Submit, emit: Emit) -> None:
        """Admit `request` by predicted delay and queue it; its answer goes to `emit`
        (exactly once for an embedding: one `Output` or one `Failure`)."""
        rejection = self._admit(request)
        if rejection is not None:
            self.metrics.rejected.labels(request.model, rejection.reason.value).inc()
            emit(
                Failure(
                    request.request_id,
                    FailureKind.REJECTED,
                    rejection.message,
                    rejection.reason.value,
                    rejection.retry_after_s,
                )
            )
            return
        batcher = self.batchers[request.model]
        try:
            futures = batcher.submit(request.payload.token_ids, request.deadline)
        except ValueError as error:
            emit(Failure(request.request_id, FailureKind.BAD_REQUEST, str(error)))
            return
        depth = self.queued_inputs()
        self._queue_high_water = max(self._queue_high_water, depth)
        key = (origin, request.request_id)
        arrival = _Arrival(depth - len(futures), self.telemetry.read()) if self._reports else None
        task = asyncio.create_task(self._answer(request, futures, emit, arrival))
        self._requests[key] = task
        task.add_done_callback(lambda _: self._requests.pop(key, None))

    def _admit(self, request: Submit) -> Rejected | None:
        if not self._ready:
            return Rejected(RejectReason.NOT_READY, "the engine is warming up", 1.0)
        batcher = self.batchers.get(request.model)
        if batcher is None:
            return Rejected(RejectReason.NOT_READY, f"model {request.model!r} is not loaded")
        token_ids = request.payload.token_ids
        if self.queued_inputs() + len(token_ids) > self.settings.max_queue:
            return Rejected(
                RejectReason.QUEUE,
                f"{self.queued_inputs()} inputs queued (cap {self.settings.max_queue})",
                self.backlog_seconds(),
            )
        scheduler = batcher.scheduler
        policy = scheduler.policy
        bucket = policy.length_bucket_for(max(len(ids) for ids in token_ids))
        if bucket is None:
            return None  # refused as a bad request by `submit`
        rows = min(len(token_ids), policy.max_batch(bucket))
        own = scheduler.estimated_compute(BatchShape(policy.padded_batch(bucket, rows), bucket))
        estimate = DelayEstimate(backlog_s=self.backlog_seconds(), own_compute_s=own)
        return delay_verdict(
            estimate, request.deadline, self._clock(), self.settings.max_queue_delay_ms / 1000
        )

    @property
    def _reports(self) -> bool:
        return self.settings.spike_reports

    async def _answer(
        self,
        request: Submit,
        futures: list[asyncio.Future[ItemResult]],
        emit: Emit,
        arrival: _Arrival | None = None,
    ) -> None:
        request_id = request.request_id
        try:
            results: list[ItemResult] = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()
            return  # the front end cancelled: it expects no answer
        except DeadlineExceeded:
            self.metrics.rejected.labels(request.model, RejectReason.DEADLINE.value).inc()
            emit(Failure(request_id, FailureKind.DEADLINE, "deadline passed in the queue"))
            return
        except BatchFailed as error:
            emit(Failure(request_id, FailureKind.FAILED, f"batch failed: {error}"))
            return
        vectors = np.ascontiguousarray(np.stack([r.vector for r in results]), dtype=np.float32)
        emit(
            Output(
                request_id,
                final=True,
                payload=EmbedOutput(
                    vectors=vectors.tobytes(),
                    rows=vectors.shape[0],
                    width=vectors.shape[1],
                    input_tokens=sum(len(ids) for ids in request.payload.token_ids),
                ),
                queue_s=max(r.queue_wait_s for r in results),
                compute_s=max(r.compute_s for r in results),
                trace=None if arrival is None else self._trace(results, arrival),
            )
        )

    def _trace(self, results: list[ItemResult], arrival: _Arrival) -> EngineTrace:
        """The request's engine trace: its last-finishing input's batch and the probes'
        changes since it arrived."""
        slowest = max(results, key=lambda r: r.queue_wait_s + r.compute_s)
        batch: BatchTrace | None = slowest.batch
        return EngineTrace(
            pid=os.getpid(),
            queue_depth_at_arrival=arrival.queue_depth,
            batch=batch,
            probes=changes(arrival.readings, self.telemetry.read()),
        )

    def cancel(self, origin: bytes, request_id: int) -> None:
        """Drop a request's queued inputs (its client went away); no answer follows."""
        task = self._requests.pop((origin, request_id), None)
        if task is not None:
            task.cancel()

    # --- debug --------------------------------------------------------------------------
    def debug_report(self, what: str) -> dict[str, object]:
        if what == "pool":
            return pool_report(self.batchers)
        if what == "config":
            return config_report(self.device, self.dispatcher.plan)
        raise ValueError(f"unknown debug report {what!r}")

    # --- shutdown -----------------------------------------------------------------------
    async def stop(self) -> None:
        """Finish what is queued and running, then stop the threads."""
        for batcher in self.batchers.values():
            await batcher.close()
        await self.telemetry.stop()
        self.dispatcher.shutdown()
