"""The serving pipeline behind the routes: load -> warm up -> ready; admit -> tokenize ->
batch -> answer; drain on shutdown.

`Service` is created and called on the event loop thread; model loading, tokenizing of large
requests and all compute run on the dispatcher's threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from app.admission import Admission, AdmissionLimits, Rejected, RejectReason, resolve_deadline
from app.batcher import DeadlineExceeded, ItemResult, ModelBatcher
from app.buffers import BufferPool
from app.dispatcher import Dispatcher, plan_threads
from app.gate import AdmissionGate
from app.metrics import Metrics
from app.models.base import InputTooLong, ModelRunner, resolve_device
from app.settings import Settings, export_cuda_alloc_conf
from app.startup import RunnerLoader, freeze_startup_heap, init_cuda, load_runner, policy_for
from app.telemetry.cgroup import available_cpus
from app.timing import PhaseTimer

log = logging.getLogger(__name__)

# Tokenizing a few short texts takes tens of microseconds: less than the hop to a thread.
# Larger requests go to the tokenizer pool so they cannot stall the event loop.
INLINE_TOKENIZE_MAX_CHARS = 2048


class UnknownModel(Exception):
    def __init__(self, name: str, known: Sequence[str]) -> None:
        super().__init__(f"model {name!r} is not served; available: {', '.join(known)}")


@dataclass(frozen=True, slots=True)
class EmbedResult:
    model: str
    vectors: npt.NDArray[np.float32]
    input_tokens: int


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    status: str
    warmup_done: int
    warmup_total: int
    error: str | None = None


def _normalize_rows(vectors: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    normalized: npt.NDArray[np.float32] = vectors / np.maximum(norms, np.float32(1e-12))
    return normalized


class Service:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        loader: RunnerLoader = load_runner,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._loader = loader
        self._clock = clock
        self.admission = Admission(
            AdmissionLimits(
                max_inflight=settings.max_inflight,
                max_queue=settings.max_queue,
                default_timeout_s=settings.default_timeout_ms / 1000,
                max_timeout_s=settings.max_timeout_ms / 1000,
            )
        )
        self.gate = AdmissionGate(
            self.admission,
            rate_per_s=settings.rate_limit_per_s,
            burst=settings.rate_limit_burst,
            max_wait_s=settings.max_admission_wait_ms / 1000,
            metrics=metrics,
            clock=clock,
        )
        self.device = resolve_device(settings.device)
        self._cuda_alloc_conf: str | None = None
        if self.device.type == "cuda":
            # CUDA reads the allocator configuration once, when it initialises: set the
            # default before anything (the compute threads' streams included) touches it.
            self._cuda_alloc_conf = export_cuda_alloc_conf(settings)
        self.dispatcher = Dispatcher(
            plan_threads(
                compute_threads=settings.dispatcher_threads,
                tokenizer_threads=settings.tokenizer_threads,
                torch_threads=settings.torch_threads,
                torch_interop_threads=settings.torch_interop_threads,
                cpus=available_cpus(),
            ),
            self.device,
        )
        self.batchers: dict[str, ModelBatcher] = {}
        self._warmup_done = 0
        self._warmup_total = 0
        self._ready = False
        self._startup_error: str | None = None
        self._idle = asyncio.Event()
        self._arrival = asyncio.Event()

    # --- start-up -----------------------------------------------------------------------
    async def start(self) -> None:
        """Load every model, preallocate its buffers, warm up every shape, then be ready.
        Failures are kept for /readyz and /healthz rather than raised."""
        try:
            await self._start()
        except Exception as error:
            log.exception("start-up failed")
            self._startup_error = f"{type(error).__name__}: {error}"

    async def _start(self) -> None:
        started = time.perf_counter()
        if self.device.type == "cuda":
            await self.dispatcher.run_compute(init_cuda, self.device, self._cuda_alloc_conf)
        runners: dict[str, ModelRunner] = {}
        for spec in self.settings.models:
            runners[spec.name] = await self.dispatcher.run_compute(
                self._loader, spec, self.device, self.settings.length_buckets[-1]
            )
        for name, runner in runners.items():
            policy = policy_for(self.settings, runner.max_input_tokens)
            warmup_shapes = len(policy.shapes()) if self.settings.warmup else 0
            # Preallocation touches the device (and pins host memory): a compute-thread job.
            pool = await self.dispatcher.run_compute(
                BufferPool,
                policy.shapes(),
                runner.output_width,
                runner.device,
                self.settings.pool_slots_per_shape or self.dispatcher.capacity,
            )
            self._record_pool(name, pool)
            self.batchers[name] = ModelBatcher(
                runner, policy, pool, self.dispatcher, self.admission, self.metrics, self._clock
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
            "ready in %.1f s (%d shapes warmed up)",
            time.perf_counter() - started,
            self._warmup_done,
        )

    def _record_pool(self, name: str, pool: BufferPool) -> None:
        self.metrics.pool_bytes.labels(name).set(pool.bytes_preallocated)
        log.info(
            "%s: buffer pool %d shapes, %.1f MiB",
            name,
            len(pool.stats().slots),
            pool.bytes_preallocated / 2**20,
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

    def readiness(self) -> Readiness:
        if self._startup_error is not None:
            status = "failed"
        elif self.admission.draining:
            status = "draining"
        elif not self.batchers:
            status = "loading"
        elif not self._ready:
            status = "warming_up"
        else:
            status = "ready"
        return Readiness(
            ready=status == "ready",
            status=status,
            warmup_done=self._warmup_done,
            warmup_total=self._warmup_total,
            error=self._startup_error,
        )

    @property
    def alive(self) -> bool:
        return self._startup_error is None

    def model_names(self) -> list[str]:
        return [spec.name for spec in self.settings.models]

    def output_width(self, name: str) -> int | None:
        """The model's output vector width, once it is loaded."""
        batcher = self.batchers.get(name)
        return batcher.runner.output_width if batcher else None

    def model_task(self, name: str) -> str:
        return next(spec.task for spec in self.settings.models if spec.name == name)

    # --- requests -----------------------------------------------------------------------
    def resolve_model(self, name: str | None) -> str:
        chosen = name or self.settings.default_model_name
        if chosen not in self.model_names():
            raise UnknownModel(chosen, self.model_names())
        return chosen

    async def embed(
        self,
        model: str,
        texts: Sequence[str],
        *,
        normalize: bool,
        truncate: bool,
        timeout_ms: float | None,
        envoy_timeout_ms: float | None,
        timer: PhaseTimer,
    ) -> EmbedResult:
        """Admit, tokenize, batch and return one vector per text.

        Raises `Rejected` (429/503/504), `InputTooLong`, `DeadlineExceeded` or `BatchFailed`.
        Cancelling the caller's task (client gone) drops its queued inputs.
        """
        self._arrival.set()
        if not self._ready and not self.admission.draining:
            raise self.gate.reject(
                Rejected(RejectReason.NOT_READY, "warm-up has not finished"), model
            )
        now = self._clock()
        deadline = resolve_deadline(now, self.admission.limits, timeout_ms, envoy_timeout_ms)
        ticket = await self.gate.admit(model, len(texts), deadline)
        batcher = self.batchers[model]
        admitted_at = self._clock()
        timer.add("admission", admitted_at - now)
        outcome = "error"
        futures: list[asyncio.Future[ItemResult]] = []
        try:
            token_ids = await self._tokenize(batcher.runner, texts, truncate)
            tokenized_at = self._clock()
            timer.add("tokenize", tokenized_at - admitted_at)
            futures = batcher.submit(token_ids, deadline)
            try:
                results: list[ItemResult] = await asyncio.gather(*futures)
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
            timer.add("queue", max(r.queue_wait_s for r in results))
            timer.add("compute", max(r.compute_s for r in results))
            vectors = np.stack([r.vector for r in results])
            outcome = "ok"
            return EmbedResult(
                model=model,
                vectors=_normalize_rows(vectors) if normalize else vectors,
                input_tokens=sum(len(ids) for ids in token_ids),
            )
        except DeadlineExceeded:
            outcome = "deadline"
            self.metrics.rejected.labels(model, RejectReason.DEADLINE.value).inc()
            raise
        except InputTooLong:
            outcome = "bad_request"
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            finished = self._clock()
            if not futures:  # never reached the queue (e.g. an input too long)
                self.admission.left_queue(ticket.n_inputs, finished)
            self.admission.release(ticket, finished)
            self.metrics.request_duration.labels(model, "embed", outcome).observe(finished - now)
            if self.admission.draining and self.admission.inflight == 0:
                self._idle.set()

    async def _tokenize(
        self, runner: ModelRunner, texts: Sequence[str], truncate: bool
    ) -> list[list[int]]:
        if sum(len(t) for t in texts) <= INLINE_TOKENIZE_MAX_CHARS:
            return runner.tokenize(texts, truncate)
        return await self.dispatcher.run_tokenize(runner.tokenize, texts, truncate)

    # --- metrics at scrape time -----------------------------------------------------------
    def refresh_gauges(self) -> None:
        """Called by the /metrics route just before it renders."""
        m = self.metrics
        m.inflight.set(self.admission.inflight)
        m.queue_depth.set(self.admission.queued)
        m.queue_depth_max.set(self.admission.take_queue_high_water())
        for name, batcher in self.batchers.items():
            stats = batcher.pool.stats()
            for shape, total in stats.slots.items():
                labels = (name, str(shape.length), str(shape.batch))
                m.pool_slots.labels(*labels).set(total)
                m.pool_slots_in_use.labels(*labels).set(stats.in_use[shape])

    # --- shutdown -----------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Stop admitting (503) and report unready; admitted requests carry on."""
        if not self.admission.draining:
            log.info("draining: %d requests in flight", self.admission.inflight)
        self.admission.draining = True
        if self.admission.inflight == 0:
            self._idle.set()

    async def wait_drained(self, timeout_s: float, quiet_s: float) -> bool:
        """True when every admitted request was answered and no new one arrived for
        `quiet_s`, all within `timeout_s`."""
        give_up_at = self._clock() + timeout_s
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            # Nothing new is admitted while draining, but clients may still be arriving to
            # hear 503: wait until none has for `quiet_s`, within the drain timeout.
            while (remaining := give_up_at - self._clock()) > 0:
                self._arrival.clear()
                try:
                    await asyncio.wait_for(self._arrival.wait(), min(quiet_s, remaining))
                except TimeoutError:
                    break
        except TimeoutError:
            pass
        if self.admission.inflight:
            log.warning("drain timeout: %d requests still in flight", self.admission.inflight)
            return False
        log.info("drained")
        return True

    async def stop(self) -> None:
        for batcher in self.batchers.values():
            await batcher.close()
        self.dispatcher.shutdown()
