"""The engine: load -> warm up -> ready; admit by predicted delay -> batch -> stream outputs.

`EngineCore` owns one host per model (`host.py`: the task's batching, buffers and outputs),
the dispatcher's threads and the compute slots every host shares. It speaks only the
messages of `protocol.py`: `submit` takes a `Submit` and answers through `emit` (zero or
more `Output`s, then a final one or one `Failure`), whoever carries them (`process.py` over
ZeroMQ, `inprocess.py` by direct call).

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

import msgspec

from app.admission import Rejected, RejectReason
from app.compute_slots import ComputeSlots
from app.dispatcher import Dispatcher, engine_thread_plan
from app.engine.health import BatchHealth
from app.engine.host import Emit, EngineContext, EngineLoad, ModelHost, RequestTracer
from app.engine.identity import frontend_identity
from app.engine.loading import load_hosts
from app.engine.protocol import (
    PROTOCOL_CLOCK,
    EngineStatus,
    Failure,
    FailureKind,
    ModelInfo,
    Submit,
    payload_inputs,
)
from app.engine.reports import config_report
from app.engine.tracing import NO_TRACES, ProbeTracer
from app.heap import freeze_startup_heap
from app.metrics import Metrics
from app.model_queues import BatchCost, ModelWork, published_queue, wait_ahead, waits_ahead
from app.models.base import resolve_device
from app.settings import Settings
from app.startup import RunnerLoader, export_cuda_alloc_conf, load_runner
from app.telemetry.cgroup import available_cpus
from app.telemetry.cuda import CudaAllocatorProbe, CudaContextProbe
from app.telemetry.gpu import NvmlProbe
from app.telemetry.probe import Probe
from app.telemetry.recent_max import RecentMax
from app.telemetry.sampler import ProcessTelemetry

log = logging.getLogger(__name__)

RequestKey = tuple[bytes, int]  # (front end, its request id): ids are unique per front end


# What the status says of the shared backlog's cost while no model has measured one.
_UNMEASURED = BatchCost(
    seconds_per_input=0.0, batch_rows=1, full_batch_s=0.0, least_own_compute_s=0.0
)


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
            engine_thread_plan(settings, available_cpus()), self.device, clock
        )
        self.slots = ComputeSlots(self.dispatcher.capacity)
        self.health = BatchHealth(settings.unhealthy_after_failed_batches)
        self._recent_queue_high = RecentMax()
        self.hosts: dict[str, ModelHost] = {}
        self._requests: dict[RequestKey, asyncio.Task[None]] = {}
        # Inputs taken from each front end (one entry per front-end process it has served),
        # published so each front end knows which of its sends the status holds.
        self._taken_inputs: dict[bytes, int] = {}
        # Front-end processes reported dead, by identity: until when what they sent is dropped.
        self._gone_frontends: dict[bytes, float] = {}
        self._warmup_done = 0
        self._warmup_total = 0
        self._ready = False
        self._startup_error: str | None = None
        self._queue_high_water = 0
        self.cuda_context = CudaContextProbe(enabled=self.device.type == "cuda")
        self.telemetry = self._telemetry()

    def _telemetry(self) -> ProcessTelemetry:
        """The engine's probes (docs/SPIKES.md). In-process, the front end's telemetry
        already watches this process and its loop: only the device's probes are added.
        NVML and the allocator's snapshot are sampled on the sampler thread (on CUDA only:
        a CPU engine has no background probe, so no such thread)."""
        index = (self.device.index or 0) if self.device.type == "cuda" else None
        device_probes: list[Probe] = [self.cuda_context]
        if index is not None:
            device_probes += [CudaAllocatorProbe(index), NvmlProbe(index)]
        gpu = None if index is None else str(index)
        if self.settings.engine == "inprocess":
            return ProcessTelemetry("engine", self.metrics, device_probes, gpu=gpu)
        # The engine process's status publisher (engine/process.py) ticks the loop monitor.
        return ProcessTelemetry.for_process(
            "engine", self.metrics, device_probes, own_ticker=False, gpu=gpu
        )

    def _tracer(self) -> RequestTracer:
        if not self.settings.spike_reports:
            return NO_TRACES
        # Half the front end's smallest threshold: see engine/tracing.py.
        return ProbeTracer(
            self.telemetry, self._clock, self.settings.slow_request_ms / 2000, self.slots
        )

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
        context = EngineContext(
            settings=self.settings,
            device=self.device,
            dispatcher=self.dispatcher,
            slots=self.slots,
            metrics=self.metrics,
            clock=self._clock,
            record_batch=self.health.record,
            lost_device_before=self.health.lost_device_before,
            before_batch=self.cuda_context.check_thread,
            loader=self._loader,
            tracer=self._tracer(),
        )
        self.hosts = await load_hosts(context, self._cuda_alloc_conf, self.health)
        for name, host in self.hosts.items():
            self._warmup_total += host.warmup_total
            self.metrics.warmup_shapes.labels(name).set(host.warmup_total)
        for name, host in self.hosts.items():
            if self.settings.warmup:
                await self._warm_up(name, host)
            host.start()
        freeze_startup_heap("engine")
        self._ready = True
        log.info(
            "engine ready in %.1f s (%d shapes warmed up)",
            time.perf_counter() - started,
            self._warmup_done,
        )

    async def _warm_up(self, name: str, host: ModelHost) -> None:
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

        await host.warm_up(shape_done)

    @property
    def clock(self) -> Callable[[], float]:
        """What deadlines and timings are read on: time.monotonic but in tests."""
        return self._clock

    @property
    def ready(self) -> bool:
        return self._ready

    # --- status -------------------------------------------------------------------------
    def backlog_seconds(self, works: dict[str, ModelWork] | None = None) -> float:
        """Running and queued work of every model (`works`, as `model_works` says now),
        divided among the compute threads they share (the whole engine's: each model's
        admission counts less, `model_queues`)."""
        works = self.model_works() if works is None else works
        total = sum(work.running_s + work.queued_s for work in works.values())
        return total / self.slots.capacity

    def model_works(self) -> dict[str, ModelWork]:
        """Each model's running, queued and next work now (`ModelHost.work`)."""
        now = self._clock()
        return {name: host.work(now) for name, host in self.hosts.items()}

    def queued_inputs(self) -> int:
        return sum(host.queued_inputs() for host in self.hosts.values())

    def inputs_waiting_for_a_batch(self) -> int:
        """Every model's inputs waiting for a batch (`max_queue` caps each model's own): not
        generate prompts waiting for a KV slot (hosts with no batch cost; the cache limits them)."""
        return sum(host.queued_inputs() for host in self.hosts.values() if host.queues_batches)

    def status(self) -> EngineStatus:
        """What front ends shed load and answer probes from. A lost device (a sticky CUDA
        error) is `failed`: an engine process exits on it (`process.py`) and is replaced,
        but in-process nothing can restart the engine alone, and `ready` let every batch
        fail 500 while /readyz said 200."""
        if self._startup_error is not None or self.health.lost_device:
            state = "failed"
        elif not self.hosts:
            state = "loading"
        elif not self._ready:
            state = "warming_up"
        else:
            state = "ready"
        # Hosts whose requests queue no batch (generation) have no cost; a cost is 0 until
        # warm-up has measured it. The whole engine's figures, in the full batches of the
        # cheapest model per input; front ends shed by each model's own (`_model_infos`).
        by_model = {name: host.batch_cost() for name, host in self.hosts.items()}
        costs = [cost for cost in by_model.values() if cost is not None]
        works = self.model_works()  # once: the whole engine's backlog and each model's wait
        cheapest = min(
            (cost for cost in costs if cost.seconds_per_input > 0),
            key=lambda cost: cost.seconds_per_input,
            default=_UNMEASURED,
        )
        own = [cost.least_own_compute_s for cost in costs if cost.least_own_compute_s > 0]
        healthy = self._startup_error is None and self.health.healthy
        return EngineStatus(
            engine_id=self.engine_id,
            pid=os.getpid(),
            state=state,
            warmup_done=self._warmup_done,
            warmup_total=self._warmup_total,
            healthy=healthy,
            backlog_s=self.backlog_seconds(works),
            seconds_per_input=cheapest.seconds_per_input / self.slots.capacity,
            # Only what waits for a batch: generate prompts waiting for a KV slot are not
            # in the batches front ends count the queue in.
            queued_inputs=self.inputs_waiting_for_a_batch(),
            published_at=PROTOCOL_CLOCK(),  # what front ends compare it with, in tests too
            least_own_compute_s=min(own, default=0.0),
            batch_rows=cheapest.batch_rows,
            full_batch_s=cheapest.full_batch_s,
            taken_inputs=dict(self._taken_inputs),
            models=self._model_infos(works, by_model),
            problem=self._startup_error or self.health.problem,
            oldest_compute_s=self.dispatcher.oldest_compute_s(),
        )

    def _model_infos(
        self, works: dict[str, ModelWork], costs: dict[str, BatchCost | None]
    ) -> dict[str, ModelInfo]:
        """Each model's info with its own queue, which front ends shed its requests by, from
        its work and cost now."""
        workers = self.slots.capacity
        waits = waits_ahead(works, workers)
        infos = {}
        for name, host in self.hosts.items():
            cost = costs[name]
            queued = 0 if cost is None else host.queued_inputs()  # not prompts awaiting KV
            queue = published_queue(waits[name], queued, cost, workers, works[name].at_cap)
            infos[name] = msgspec.structs.replace(host.info(), queue=queue)
        return infos

    def refresh_gauges(self) -> None:
        """Engine-side gauges: the inputs waiting for a batch, every model's together
        (`max_queue` caps each model's own; generate prompts waiting for a KV slot are each model's
        `steadyserve_sequences{state="waiting"}`), their high-water mark over the last
        `HIGH_WATER_WINDOW_S`, and each host's own; called periodically, or before a scrape
        in-process."""
        m = self.metrics
        waiting = self.inputs_waiting_for_a_batch()
        m.queue_depth.set(waiting)
        high, self._queue_high_water = self._queue_high_water, waiting
        m.queue_depth_max.set(self._recent_queue_high.roll(self._clock(), high))
        if self.settings.spike_reports:
            self.telemetry.publish()
        for host in self.hosts.values():
            host.refresh_gauges()

    # --- requests -----------------------------------------------------------------------
    def submit(self, origin: bytes, request: Submit, emit: Emit) -> None:
        """Admit `request` and hand it to its model's host, with its `origin` (its `reference`
        names it in logs and answers); its answer goes to `emit` (zero or more `Output`s, then
        a final one or one `Failure`). A request from a front end reported dead is dropped
        unanswered (`frontend_gone`)."""
        if self._sent_by_a_dead_frontend(origin):
            return
        request = msgspec.structs.replace(request, origin=origin)
        taken = self._taken_inputs.get(origin, 0) + payload_inputs(request.payload)
        self._taken_inputs[origin] = taken
        rejection = self._admit(request)
        if rejection is not None:
            if not request.refusal_counted_by_sender:
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
        task = self.hosts[request.model].submit(request, emit)
        self._queue_high_water = max(self._queue_high_water, self.inputs_waiting_for_a_batch())
        if task is None:
            return
        key = (origin, request.request_id)
        self._requests[key] = task
        task.add_done_callback(lambda _: self._requests.pop(key, None))

    def _admit(self, request: Submit) -> Rejected | None:
        if self.health.lost_device:  # front ends shed on `failed`; this is what was on its way
            return Rejected(RejectReason.NOT_READY, "the engine's device is lost", 1.0)
        if not self._ready:
            return Rejected(RejectReason.NOT_READY, "the engine is warming up", 1.0)
        host = self.hosts.get(request.model)
        if host is None:
            return Rejected(RejectReason.NOT_READY, f"model {request.model!r} is not loaded")
        # Its model's own load (`model_queues`): another model's flood counts by its turns.
        works = self.model_works()
        load = EngineLoad(
            model=request.model,
            queued_inputs=host.queued_inputs(),
            backlog_s=wait_ahead(request.model, works, self.slots.capacity),
            now=self._clock(),
            max_queue=self.settings.max_queue,
            max_queue_delay_s=self.settings.max_queue_delay_ms / 1000,
            workers=self.slots.capacity,
            works=works,
        )
        return host.admit(request, load)

    def cancel(self, origin: bytes, request_id: int) -> None:
        """Drop a request's queued work (its client went away); no answer follows."""
        task = self._requests.pop((origin, request_id), None)
        if task is not None:
            task.cancel()

    def frontend_gone(self, pid: int, token: int) -> None:
        """Drop the work of every request the front-end process `pid` started with `token`
        sent (it exited: no one reads their answers) and forget the inputs it sent
        (`taken_inputs`). Its Submits still on their way are dropped as they come (the
        engine's socket takes one message from each peer in turn, so this notice can
        overtake them), for as long as any of them could still be within its deadline; a
        front end started later under the same pid has another identity, and is served."""
        gone = frontend_identity(pid, token)
        now = self._clock()
        self._gone_frontends = {o: t for o, t in self._gone_frontends.items() if t > now}
        self._gone_frontends[gone] = now + self.settings.max_timeout_ms / 1000
        orphans = [key for key in self._requests if key[0] == gone]
        for key in orphans:
            self._requests.pop(key).cancel()
        self._taken_inputs.pop(gone, None)
        name = gone.decode()
        log.warning("front end %s exited: dropped the work of its %d requests", name, len(orphans))

    def _sent_by_a_dead_frontend(self, origin: bytes) -> bool:
        until = self._gone_frontends.get(origin)
        return until is not None and self._clock() < until

    # --- debug --------------------------------------------------------------------------
    def debug_report(self, what: str) -> dict[str, object]:
        if what == "pool":
            return {name: host.debug_report() for name, host in self.hosts.items()}
        if what == "config":
            return config_report(self.device, self.dispatcher.plan)
        raise ValueError(f"unknown debug report {what!r}")

    # --- shutdown -----------------------------------------------------------------------
    async def stop(self) -> None:
        """Finish what is queued and running, then stop the threads; not ready, at once
        (a load or warm-up running is abandoned, not waited for: `Dispatcher.shutdown`)."""
        for host in self.hosts.values():
            await host.close()
        await self.telemetry.stop()
        self.dispatcher.shutdown(wait=self._ready)
