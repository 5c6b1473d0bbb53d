"""The `tensor` task in the engine: named tensors in, named tensors out, through the
scheduler, a preallocated pool of slots of the declared dtypes (`tensor_batch.py`) and the
shared compute slots.

Each row of a request (its batch dimension) is one queued input; its length is its
longest dynamic dimension, bucketed like token lengths (`settings.length_buckets`); a model
without dynamic dimensions has the one length bucket 1.

Event loop thread only; batches run on dispatcher compute threads, and a large answer's
rows are stacked on the host's own stacking thread (`stacked_outputs`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np

from app.admission import Rejected
from app.batch_trace import ItemResult
from app.batcher import Batcher
from app.engine.host import Emit, EngineContext, EngineLoad, ShapeDone, payload_kind
from app.engine.protocol import (
    Failure,
    FailureKind,
    ModelInfo,
    Output,
    Submit,
    TensorData,
    TensorOutput,
    TensorPayload,
)
from app.engine.rows import (
    BatchedHost,
    admit_rows,
    answer_rows,
    final_output,
    record_pool,
)
from app.model_specs import ModelSpec, TensorSpec
from app.models.tensor import TensorModel, load_tensor_model
from app.scheduler import BatchPolicy, BatchShape
from app.settings import Settings
from app.tensor_batch import (
    Array,
    TensorBatchOutput,
    TensorPool,
    TensorRow,
    run_tensor_batch,
    tensor_pool,
    warmup_rows,
)
from app.tensors import RequestShape, TensorError, check_request, from_bytes

TensorBatcher = Batcher[TensorRow, tuple[Array, ...]]

# Answers of more bytes than this are stacked off the event loop: a MiB copies in well
# under a millisecond, and a thread hop costs about a tenth of one. On the loop, 64 rows of
# a 512 x 1024 FP32 output (128 MiB) stalled every model's batch loop and the status
# publisher (0.2 s stacking, 0.1 s into bytes, on a 2-CPU test machine).
STACK_ON_LOOP_MAX_BYTES = 1 << 20


def tensor_policy(spec: ModelSpec, settings: Settings) -> BatchPolicy:
    """The length buckets of the settings where a declared tensor has a dynamic dimension
    besides the batch; else the single length 1 (batches differ in rows only)."""
    dynamic = any(t.dynamic for t in spec.inputs)
    return BatchPolicy(
        length_buckets=settings.length_buckets if dynamic else (1,),
        max_batch_size=settings.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens if dynamic else settings.max_batch_size,
        max_wait_s=settings.max_wait_ms / 1000,
    )


def request_rows(
    model: TensorModel, payload: TensorPayload
) -> tuple[RequestShape, list[TensorRow]]:
    """Check the payload against the model's specs and split it into rows; raises
    `TensorError` (the front end checks the same, so only a misbehaving one sends it)."""
    by_name = {tensor.name: tensor for tensor in payload.inputs}
    if len(by_name) != len(payload.inputs):
        raise TensorError("an input is named twice")
    shape = check_request(model.inputs, {t.name: (t.datatype, t.shape) for t in payload.inputs})
    arrays = [
        from_bytes(spec.datatype, by_name[spec.name].shape, by_name[spec.name].data, spec.name)
        for spec in model.inputs
    ]
    rows = [
        TensorRow(tuple(array[index] for array in arrays), shape.length)
        for index in range(shape.rows)
    ]
    return shape, rows


def stack_outputs(
    specs: Sequence[TensorSpec], rows: Sequence[tuple[Array, ...]]
) -> list[TensorData]:
    """Each output (in spec order) of a request's `rows`, stacked along the batch
    dimension into its row-major bytes. Any thread."""
    outputs = []
    for index, spec in enumerate(specs):
        stacked = np.ascontiguousarray(np.stack([row[index] for row in rows]))
        outputs.append(TensorData(spec.name, spec.datatype, list(stacked.shape), stacked.tobytes()))
    return outputs


async def stacked_outputs(
    specs: Sequence[TensorSpec], rows: Sequence[tuple[Array, ...]], stacker: Executor
) -> list[TensorData]:
    """`stack_outputs`, on `stacker` (the host's one stacking thread) when the rows hold
    more than `STACK_ON_LOOP_MAX_BYTES`, so the loop runs on while they are copied: a
    request's rows may come from several batches, so no one compute thread has them all
    (`np.stack` lets go of the GIL while it copies; the one copy into `bytes` holds it).
    Event loop thread only."""
    if sum(array.nbytes for row in rows for array in row) <= STACK_ON_LOOP_MAX_BYTES:
        return stack_outputs(specs, rows)
    return await asyncio.get_running_loop().run_in_executor(stacker, stack_outputs, specs, rows)


class TensorHost(BatchedHost):
    task = "tensor"

    def __init__(
        self, model: TensorModel, pool: TensorPool, batcher: TensorBatcher, context: EngineContext
    ) -> None:
        super().__init__()
        self.name = model.name
        self.model = model
        self.pool = pool
        self.batcher: TensorBatcher = batcher
        self._context = context
        # One thread, started on the first large answer: asyncio's default executor ran
        # these copies on up to min(32, CPUs + 4) threads, beyond the CPU budget that
        # `check-config` sizes (compute threads x torch threads). Copies only, never model
        # code; answers wait their turn on it.
        self._stacker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="steadyserve-stack")

    def info(self) -> ModelInfo:
        return ModelInfo(task="tensor", output_width=0, max_input_tokens=0)

    async def warm_up(self, shape_done: ShapeDone) -> None:
        await self.batcher.warm_up_rows(lambda shape: warmup_rows(self.model, shape), shape_done)

    def admit(self, request: Submit, load: EngineLoad) -> Rejected | None:
        payload = request.payload
        if not isinstance(payload, TensorPayload):
            return None  # refused as a bad request by `submit`
        try:
            shape = check_request(
                self.model.inputs, {t.name: (t.datatype, t.shape) for t in payload.inputs}
            )
        except TensorError:
            return None  # refused as a bad request by `submit`
        return admit_rows(self.batcher.scheduler, load, shape.rows, shape.length, request.deadline)

    def submit(self, request: Submit, emit: Emit) -> asyncio.Task[None] | None:
        payload = request.payload
        if not isinstance(payload, TensorPayload):
            message = f"model {self.name!r} takes tensors; it was sent {payload_kind(request)}"
            emit(Failure(request.request_id, FailureKind.BAD_REQUEST, message))
            return None
        try:
            shape, rows = request_rows(self.model, payload)
            futures = self.batcher.submit(rows, request.deadline, unit="elements")
        except ValueError as error:  # TensorError included
            emit(Failure(request.request_id, FailureKind.BAD_REQUEST, str(error)))
            return None
        arrival = self._context.tracer.arrive(self.queued_inputs() - len(futures))
        return self._answering(self._answer(request, shape, futures, emit, arrival), futures)

    async def _answer(
        self,
        request: Submit,
        shape: RequestShape,
        futures: list[asyncio.Future[ItemResult[tuple[Array, ...]]]],
        emit: Emit,
        arrival: object | None,
    ) -> None:
        async def output(results: list[ItemResult[tuple[Array, ...]]]) -> Output:
            values = [r.value for r in results]
            outputs = await stacked_outputs(self.model.outputs, values, self._stacker)
            tracer = self._context.tracer
            return final_output(request, TensorOutput(outputs), results, tracer, arrival)

        await answer_rows(futures, request, emit, self._context.metrics, output)

    async def close(self) -> None:
        """Finish queued and running batches, then the answers they leave (each may still
        be stacking), then stop the stacking thread: nothing is left for it, so joining
        it returns at once (but for the copy of an answer cancelled mid-way)."""
        await super().close()
        self._stacker.shutdown(wait=True)


async def load_tensor_host(spec: ModelSpec, context: EngineContext) -> TensorHost:
    """Load the program (compute thread), make its batch policy and preallocate its slots
    (also on a compute thread: it touches the device and pins host memory)."""
    settings, dispatcher = context.settings, context.dispatcher
    model = await dispatcher.run_compute(load_tensor_model, spec, context.device)
    policy = tensor_policy(spec, settings)
    pool = await dispatcher.run_compute(
        tensor_pool, model, policy.shapes(), settings.pool_slots_per_shape or dispatcher.capacity
    )
    record_pool(spec.name, pool, context, "tensor slots for")

    def execute(shape: BatchShape, rows: Sequence[TensorRow]) -> TensorBatchOutput:
        """Compute threads only: split in halves where an allocation failed."""
        return run_tensor_batch(
            pool,
            model,
            shape,
            rows,
            dispatcher.stream(),
            lambda count: BatchShape(policy.padded_batch(shape.length, count), shape.length),
        )

    batcher: TensorBatcher = Batcher(
        spec.name,
        policy,
        execute,
        lambda row: row.length,
        dispatcher,
        context.slots,
        context.metrics,
        context.clock,
        context.record_batch,
        before_batch=context.before_batch,
        lost_device_before=context.lost_device_before,
    )
    return TensorHost(model, pool, batcher, context)
