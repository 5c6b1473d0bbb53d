"""The `embed` task in the engine: token ids in, one vector per input out, through the
scheduler, the preallocated buffer pool and the shared compute slots (`batcher.py`).

Event loop thread only; batches run on dispatcher compute threads.
"""

from __future__ import annotations

import asyncio

import numpy as np
import numpy.typing as npt

from app.admission import Rejected
from app.batch_trace import ItemResult
from app.buffers import BufferPool
from app.engine.host import Emit, EngineContext, EngineLoad, ShapeDone, payload_kind
from app.engine.protocol import (
    EmbedOutput,
    EmbedPayload,
    Failure,
    FailureKind,
    ModelInfo,
    Output,
    Submit,
)
from app.engine.rows import (
    BatchedHost,
    admit_rows,
    answer_rows,
    final_output,
    record_pool,
)
from app.model_batcher import ModelBatcher
from app.model_specs import ModelSpec
from app.startup import policy_for


def payload_problem(payload: EmbedPayload) -> str | None:
    """Why the engine cannot embed `payload` as sent, or None: no inputs (the longest of
    none has no length: `admit` raised, a 500), or an input of no tokens (its attention
    mask all zeros, which some kernels turn into NaN: `BufferSlot.write_inputs`). A front
    end sends neither (it refuses empty texts and tokenizes with the model's special
    tokens); one misbehaving, or of another version, gets `BAD_REQUEST`, a 400."""
    if not payload.token_ids:
        return "no inputs: token_ids is empty"
    for index, ids in enumerate(payload.token_ids):
        if not ids:
            return f"input {index} has no tokens"
    return None


class EmbeddingHost(BatchedHost):
    task = "embed"

    def __init__(self, batcher: ModelBatcher, context: EngineContext) -> None:
        super().__init__()
        self.name = batcher.runner.name
        self.batcher: ModelBatcher = batcher
        self.pool = batcher.pool
        self._context = context

    def info(self) -> ModelInfo:
        runner = self.batcher.runner
        return ModelInfo(
            task=runner.task,
            output_width=runner.output_width,
            max_input_tokens=runner.max_input_tokens,
        )

    async def warm_up(self, shape_done: ShapeDone) -> None:
        await self.batcher.warm_up(self.batcher.runner.pad_token_id + 1, shape_done)

    def admit(self, request: Submit, load: EngineLoad) -> Rejected | None:
        if not isinstance(request.payload, EmbedPayload):
            return None  # refused as a bad request by `submit`
        if payload_problem(request.payload) is not None:
            return None  # likewise
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
        problem = payload_problem(payload)
        if problem is not None:
            emit(Failure(request.request_id, FailureKind.BAD_REQUEST, problem))
            return None
        try:
            futures = self.batcher.submit(payload.token_ids, request.deadline)
        except ValueError as error:
            emit(Failure(request.request_id, FailureKind.BAD_REQUEST, str(error)))
            return None
        arrival = self._context.tracer.arrive(self.queued_inputs() - len(futures))
        return self._answering(self._answer(request, payload, futures, emit, arrival), futures)

    async def _answer(
        self,
        request: Submit,
        request_payload: EmbedPayload,
        futures: list[asyncio.Future[ItemResult[npt.NDArray[np.float32]]]],
        emit: Emit,
        arrival: object | None,
    ) -> None:
        async def output(results: list[ItemResult[npt.NDArray[np.float32]]]) -> Output:
            vectors = np.ascontiguousarray(np.stack([r.value for r in results]), np.float32)
            payload = EmbedOutput(
                vectors=vectors.tobytes(),
                rows=vectors.shape[0],
                width=vectors.shape[1],
                input_tokens=sum(len(ids) for ids in request_payload.token_ids),
            )
            return final_output(request, payload, results, self._context.tracer, arrival)

        await answer_rows(futures, request, emit, self._context.metrics, output)


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
    record_pool(spec.name, pool, context, "buffer pool")
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
        lost_device_before=context.lost_device_before,
    )
    return EmbeddingHost(batcher, context)
