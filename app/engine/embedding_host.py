"""The `embed` task in the engine: token ids in, one vector per input out, through the
scheduler, the preallocated buffer pool and the shared compute slots (`batcher.py`).

Event loop thread only; batches run on dispatcher compute threads.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import numpy.typing as npt

from app.admission import Rejected
from app.batcher import ItemResult, ModelBatcher
from app.buffers import BufferPool
from app.engine.host import Emit, EngineContext, EngineLoad, ShapeDone
from app.engine.protocol import (
    EmbedOutput,
    EmbedPayload,
    Failure,
    FailureKind,
    ModelInfo,
    Output,
    Submit,
)
from app.engine.rows import admit_rows, gather_rows
from app.model_specs import ModelSpec
from app.startup import policy_for

log = logging.getLogger(__name__)


class EmbeddingHost:
    def __init__(self, batcher: ModelBatcher, context: EngineContext) -> None:
        self.name = batcher.runner.name
        self.batcher = batcher
        self._context = context

    def info(self) -> ModelInfo:
        runner = self.batcher.runner
        return ModelInfo(
            task=runner.task,
            output_width=runner.output_width,
            max_input_tokens=runner.max_input_tokens,
        )

    @property
    def warmup_total(self) -> int:
        return len(self.batcher.scheduler.policy.shapes()) if self._context.settings.warmup else 0

    async def warm_up(self, shape_done: ShapeDone) -> None:
        await self.batcher.warm_up(self.batcher.runner.pad_token_id + 1, shape_done)

    def start(self) -> None:
        self.batcher.start()

    def backlog_seconds(self) -> float:
        return self.batcher.scheduler.backlog_seconds()

    def seconds_per_input(self) -> float:
        scheduler = self.batcher.scheduler
        return scheduler.seconds_per_input(scheduler.policy.length_buckets[0])

    def queued_inputs(self) -> int:
        return self.batcher.scheduler.depth

    def admit(self, request: Submit, load: EngineLoad) -> Rejected | None:
        if not isinstance(request.payload, EmbedPayload):
            return None  # refused as a bad request by `submit`
        token_ids = request.payload.token_ids
        longest = max(len(ids) for ids in token_ids)
        return admit_rows(self.batcher.scheduler, load, len(token_ids), longest, request.deadline)

    def submit(self, request: Submit, emit: Emit) -> asyncio.Task[None] | None:
        payload = request.payload
        if not isinstance(payload, EmbedPayload):
            message = (
                f"model {self.name!r} computes embeddings; it was sent {payload_kind(request)}"
            )
            emit(Failure(request.request_id, FailureKind.BAD_REQUEST, message))
            return None
        try:
            futures = self.batcher.submit(payload.token_ids, request.deadline)
        except ValueError as error:
            emit(Failure(request.request_id, FailureKind.BAD_REQUEST, str(error)))
            return None
        arrival = self._context.tracer.arrive(self.queued_inputs() - len(futures))
        return asyncio.create_task(self._answer(request, payload, futures, emit, arrival))

    async def _answer(
        self,
        request: Submit,
        payload: EmbedPayload,
        futures: list[asyncio.Future[ItemResult[npt.NDArray[np.float32]]]],
        emit: Emit,
        arrival: object | None,
    ) -> None:
        results = await gather_rows(futures, request, emit, self._context.metrics)
        if results is None:
            return
        vectors = np.ascontiguousarray(np.stack([r.value for r in results]), dtype=np.float32)
        # The request's batch in its trace is its last-finishing input's.
        slowest = max(results, key=lambda r: r.queue_wait_s + r.compute_s)
        emit(
            Output(
                request.request_id,
                final=True,
                payload=EmbedOutput(
                    vectors=vectors.tobytes(),
                    rows=vectors.shape[0],
                    width=vectors.shape[1],
                    input_tokens=sum(len(ids) for ids in payload.token_ids),
                ),
                queue_s=max(r.queue_wait_s for r in results),
                compute_s=max(r.compute_s for r in results),
                trace=self._context.tracer.finish(arrival, slowest.batch),
            )
        )

    def refresh_gauges(self) -> None:
        metrics = self._context.metrics
        stats = self.batcher.pool.stats()
        for shape, total in stats.slots.items():
            labels = (self.name, str(shape.length), str(shape.batch))
            metrics.pool_slots.labels(*labels).set(total)
            metrics.pool_slots_in_use.labels(*labels).set(stats.in_use[shape])

    def debug_report(self) -> dict[str, object]:
        """Bytes preallocated, misses, waits, and each shape's slots, slots in use and
        estimated compute."""
        stats = self.batcher.pool.stats()
        return {
            "task": "embed",
            "bytes_preallocated": stats.bytes_preallocated,
            "misses": stats.misses,
            "acquire_waits": stats.acquire_waits,
            "shapes": [
                {
                    "batch": shape.batch,
                    "length": shape.length,
                    "slots": total,
                    "in_use": stats.in_use[shape],
                    "estimated_compute_ms": round(
                        self.batcher.scheduler.estimated_compute(shape) * 1000, 3
                    ),
                }
                for shape, total in stats.slots.items()
            ],
        }

    async def close(self) -> None:
        await self.batcher.close()


def payload_kind(request: Submit) -> str:
    """The task a request's payload is for (its msgpack tag), for error messages."""
    return f"a {type(request.payload).__struct_config__.tag!s} request"


async def load_embedding_host(spec: ModelSpec, context: EngineContext) -> EmbeddingHost:
    """Load the model (compute thread), make its batch policy and preallocate its buffer
    pool (also on a compute thread: it touches the device and pins host memory)."""
    settings, dispatcher = context.settings, context.dispatcher
    runner = await dispatcher.run_compute(
        context.loader, spec, context.device, settings.length_buckets[-1]
    )
    policy = policy_for(settings, runner.max_input_tokens)
    pool = await dispatcher.run_compute(
        BufferPool,
        policy.shapes(),
        runner.output_width,
        runner.device,
        settings.pool_slots_per_shape or dispatcher.capacity,
    )
    context.metrics.pool_bytes.labels(spec.name).set(pool.bytes_preallocated)
    log.info(
        "%s: buffer pool %d shapes, %.1f MiB",
        spec.name,
        len(pool.stats().slots),
        pool.bytes_preallocated / 2**20,
    )
    batcher = ModelBatcher(
        runner,
        policy,
        pool,
        dispatcher,
        context.slots,
        context.metrics,
        context.clock,
        context.record_batch,
        before_batch=context.before_batch,
    )
    return EmbeddingHost(batcher, context)
