"""What every batched host (one whose requests are rows queued into a `Batcher`: `embed`,
`tensor`) shares: admission by predicted delay, waiting for the rows' results (or answering
why there are none), the final output with its trace, and `BatchedHost`, the `ModelHost`
methods answered from the batcher and its slot pool alone (load, warm-up count, pool
gauges, `/debug/pool` report, a close that waits for the requests' answers).

Event loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from app.admission import BatchQueue, Rejected, RejectReason, batch_delay, delay_verdict
from app.batch_trace import ItemResult
from app.batcher import Batcher
from app.buffers import SlotPool
from app.engine.host import Emit, EngineContext, EngineLoad, RequestTracer
from app.engine.lost_device import device_lost_failure
from app.engine.protocol import Failure, FailureKind, Output, OutputPayload, Submit
from app.failures import BatchFailed, DeadlineExceeded, DeviceLost, InputFailed, NonFiniteOutput
from app.metrics import Metrics
from app.model_queues import NO_WORK, BatchCost, ModelWork, naming, wait_ahead
from app.scheduler import BatchShape, Scheduler

log = logging.getLogger(__name__)

OutT = TypeVar("OutT")


def admit_rows(
    scheduler: Scheduler, load: EngineLoad, rows: int, longest: int, deadline: float
) -> Rejected | None:
    """None to queue `rows` inputs (the longest `longest` tokens or elements long) for
    `load.model`; else why not, naming the model: its queue at the cap, or its predicted
    wait (its own backlog, the other models' turns counted where the request queues:
    `bucket_wait`; its queue counted in whole batches of the request's bucket, plus its
    own batch: `batch_delay`) over the delay budget or past its deadline.
    A request that fits no length bucket is let through, whatever the queue: `submit`
    answers it 400 (refused 429 `queue` first, its client retried what can never be
    served)."""
    policy = scheduler.policy
    bucket = policy.length_bucket_for(longest)
    if bucket is None:
        return None
    if load.queued_inputs + rows > load.max_queue:
        return Rejected(
            RejectReason.QUEUE,
            f"model {load.model!r}: {load.queued_inputs} inputs queued (cap {load.max_queue})",
            load.backlog_s,
        )
    full_rows, full_batch_s = scheduler.full_batch(bucket)
    queued = scheduler.queued(bucket)
    last_batch = (queued + rows - 1) // full_rows  # its bucket's that its last input runs in
    queue = BatchQueue(
        backlog_s=bucket_wait(load, -(-queued // full_rows), last_batch),
        queued=queued,
        seconds_per_input=full_batch_s / full_rows / load.workers,
        batch_rows=full_rows,
        full_batch_s=full_batch_s,
    )
    # The rows of the batch its last input runs in, as queued so far.
    last_batch_rows = (queued + rows - 1) % full_rows + 1
    partial_s = scheduler.estimated_compute(
        BatchShape(policy.padded_batch(bucket, last_batch_rows), bucket)
    )
    estimate = batch_delay(queue, rows, partial_s)
    return naming(load.model, delay_verdict(estimate, deadline, load.now, load.max_queue_delay_s))


def bucket_wait(load: EngineLoad, bucket_batches: int, last_batch: int) -> float:
    """`load.backlog_s` with a turn of every other model counted before each batch of
    `load.model` queued in its other length buckets and each of its own bucket's up to
    its `last_batch` (`model_queues.wait_ahead`'s `rounds`), its own bucket holding
    `bucket_batches` (the others': all the model's batches, `ModelWork.turns`, but
    those). `backlog_s` alone counts all of the model's batches but a partial one an
    input may join (the least over the buckets, what front ends judge before the body):
    one short for an input in another bucket than that partial batch, which runs first
    (the scheduler takes ready buckets oldest first), and for one whose rows fill several
    batches, each a turn of the others. `backlog_s` alone too when `load` holds no works."""
    if load.works is None:
        return load.backlog_s
    own = load.works.get(load.model, NO_WORK)
    rounds = own.turns - bucket_batches + last_batch + 1
    if rounds == own.batches_ahead + 1:
        return load.backlog_s  # what it was computed with
    return wait_ahead(load.model, load.works, load.workers, rounds)


def answering(
    task: asyncio.Task[None], futures: Sequence[asyncio.Future[Any]]
) -> asyncio.Task[None]:
    """`task`, which answers a request from its rows' `futures`, with its rows dropped when
    it is cancelled, even before it first runs (its Submit and Cancel read in one engine
    turn): `gather_rows` drops them only once it runs."""

    def drop_rows(done: asyncio.Task[None]) -> None:
        if done.cancelled():
            for future in futures:
                future.cancel()

    task.add_done_callback(drop_rows)
    return task


async def gather_rows(
    futures: list[asyncio.Future[ItemResult[OutT]]],
    request: Submit,
    emit: Emit,
    metrics: Metrics,
) -> list[ItemResult[OutT]] | None:
    """Every row's result, in order; or None once the request was answered with its
    failure (a deadline passed, an input the model fails on, a failed batch, an output
    with a NaN: `FAILED` of reason `NonFiniteOutput.REASON`) or cancelled by its front end
    (which expects no answer). Either way its rows still queued are dropped: nobody
    would read what they compute."""
    try:
        return await asyncio.gather(*futures)
    except asyncio.CancelledError:
        return None
    except DeadlineExceeded as error:
        metrics.rejected.labels(request.model, RejectReason.DEADLINE.value).inc()
        emit(Failure(request.request_id, FailureKind.DEADLINE, str(error)))
        return None
    except InputFailed as error:
        emit(input_failure(request, futures, error))
        return None
    except DeviceLost as error:  # before the engine exits: `lost_device.py`
        emit(device_lost_failure(request.request_id, error))
        return None
    except BatchFailed as error:
        emit(Failure(request.request_id, FailureKind.FAILED, str(error)))
        return None
    except NonFiniteOutput as error:
        reason = NonFiniteOutput.REASON
        emit(Failure(request.request_id, FailureKind.FAILED, str(error), reason=reason))
        return None
    finally:
        for future in futures:
            future.cancel()  # a no-op for those already done


async def answer_rows(
    futures: list[asyncio.Future[ItemResult[OutT]]],
    request: Submit,
    emit: Emit,
    metrics: Metrics,
    output: Callable[[list[ItemResult[OutT]]], Awaitable[Output]],
) -> None:
    """Answer the request: its `output` of every row's result (`gather_rows`), or why
    there is none. Should making that output raise (a `MemoryError` stacking a large
    answer, the tracer), the request is answered 500 (`FAILED`: the server's fault, its
    traceback in this log): the task died unanswered, and its front end waited out the
    deadline and `ANSWER_GRACE_S` to say 503 `not_ready`."""
    results = await gather_rows(futures, request, emit, metrics)
    if results is None:
        return
    try:
        answer = await output(results)
    except Exception as error:
        log.exception(
            "request %s to %s: its rows computed, but its answer could not be made",
            request.reference,
            request.model,
        )
        message = (
            f"the server could not make the answer ({type(error).__name__}); "
            f"the server logged why under request {request.reference}"
        )
        emit(Failure(request.request_id, FailureKind.FAILED, message))
        return
    emit(answer)


def input_failure(
    request: Submit, futures: Sequence[asyncio.Future[Any]], error: InputFailed
) -> Failure:
    """The 400 of a request with an input the model fails on: which input, and the class
    of what the model raised, for the client; its text and traceback only in this log,
    under the request's reference (the model's message may hold anything, the input itself or
    the model's internals)."""
    index = next(
        (
            i
            for i, future in enumerate(futures)
            if future.done() and not future.cancelled() and future.exception() is error
        ),
        None,
    )
    cause = error.__cause__ or error
    log.warning(
        "request %s to %s: the model failed on input %s of it",
        request.reference,
        request.model,
        index,
        exc_info=error,
    )
    which = "an input" if index is None else f"input {index}"
    message = (
        f"the model could not process {which} ({type(cause).__name__}); "
        f"the server logged why under request {request.reference}"
    )
    return Failure(request.request_id, FailureKind.BAD_REQUEST, message, input_index=index)


def final_output(
    request: Submit,
    payload: OutputPayload,
    results: Sequence[ItemResult[Any]],
    tracer: RequestTracer,
    arrival: object | None,
) -> Output:
    """The request's one final `Output`: its slowest row's queue wait and compute, and its
    trace (`arrival` from `tracer.arrive`)."""
    # The request's batch in its trace is its last-finishing input's.
    slowest = max(results, key=lambda r: r.queue_wait_s + r.compute_s)
    return Output(
        request.request_id,
        final=True,
        payload=payload,
        queue_s=slowest.queue_wait_s,
        compute_s=slowest.compute_s,
        trace=tracer.finish(arrival, slowest.batch),
    )


def record_pool(name: str, pool: SlotPool[Any], context: EngineContext, what: str) -> None:
    """Once a model's pool is preallocated: its bytes gauge, and a log line naming `what`
    it holds."""
    context.metrics.pool_bytes.labels(name).set(pool.bytes_preallocated)
    log.info(
        "%s: %s %d shapes, %.1f MiB",
        name,
        what,
        len(pool.stats().slots),
        pool.bytes_preallocated / 2**20,
    )


class BatchedHost:
    """The `ModelHost` methods a batched host answers from its `batcher` and slot `pool`
    alone; a subclass calls `__init__`, sets `name`, `task`, `batcher`, `pool` and
    `_context`, and adds `info`, `warm_up`, `admit` and `submit` (its answering tasks made
    by `_answering`). Event loop thread only."""

    name: str
    task: str  # as `/debug/pool` names it
    batcher: Batcher[Any, Any]
    pool: SlotPool[Any]
    _context: EngineContext

    def __init__(self) -> None:
        # Each request's answering task until it is done: `close` waits for them.
        self._answers: set[asyncio.Task[None]] = set()

    def _answering(
        self, answer: Coroutine[Any, Any, None], futures: Sequence[asyncio.Future[Any]]
    ) -> asyncio.Task[None]:
        """A task running `answer`, which answers a request from its rows' `futures`
        (`answering`: its rows dropped if it is cancelled), kept until done for `close`."""
        task = answering(asyncio.create_task(answer), futures)
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)
        return task

    @property
    def warmup_total(self) -> int:
        return len(self.batcher.scheduler.policy.shapes()) if self._context.settings.warmup else 0

    def start(self) -> None:
        self.batcher.start()

    # Its requests are rows queued into batches (`batch_cost` is not None).
    queues_batches = True

    def work(self, now: float) -> ModelWork:
        """In one pass over its length buckets: its queued inputs in full batches (as
        `Scheduler.queued_seconds`), the batch it would run next (of the buckets holding
        inputs, the costliest batch they would close now: any may be the next ready), and
        the batches its queue runs in as the scheduler closes them (each bucket's queue in
        batches of its full rows, the last perhaps partial): those ahead of an input queued
        now (all but a partial one, which it would join: the least over the buckets it may
        queue in, which front ends do not know before the body; the engine counts its own
        bucket's, `bucket_wait`) and all of them."""
        scheduler = self.batcher.scheduler
        policy = scheduler.policy
        queued_s = next_batch_s = 0.0
        batches, partial = 0, False
        for length in policy.length_buckets:
            if not (queued := scheduler.queued(length)):
                continue
            rows, full_batch_s = scheduler.full_batch(length)
            queued_s += queued * (full_batch_s / rows)
            shape = BatchShape(policy.padded_batch(length, min(queued, rows)), length)
            next_batch_s = max(next_batch_s, scheduler.estimated_compute(shape))
            batches += -(-queued // rows)
            partial = partial or queued % rows > 0
        running_s = scheduler.running_seconds(now)
        return ModelWork(running_s, queued_s, next_batch_s, batches - partial, batches)

    def batch_cost(self) -> BatchCost:
        scheduler = self.batcher.scheduler
        policy = scheduler.policy
        smallest = policy.length_buckets[0]
        rows, full_batch_s = scheduler.full_batch(smallest)
        one_input = BatchShape(policy.padded_batch(smallest, 1), smallest)
        return BatchCost(
            seconds_per_input=full_batch_s / rows,
            batch_rows=rows,
            full_batch_s=full_batch_s,
            least_own_compute_s=scheduler.estimated_compute(one_input),
        )

    def queued_inputs(self) -> int:
        return self.batcher.scheduler.depth

    def refresh_gauges(self) -> None:
        metrics = self._context.metrics
        stats = self.pool.stats()
        for shape, total in stats.slots.items():
            labels = (self.name, str(shape.length), str(shape.batch))
            metrics.pool_slots.labels(*labels).set(total)
            metrics.pool_slots_in_use.labels(*labels).set(stats.in_use[shape])

    def debug_report(self) -> dict[str, object]:
        """Bytes preallocated, misses, waits, and each shape's slots, slots in use and
        estimated compute."""
        stats = self.pool.stats()
        return {
            "task": self.task,
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
        """Finish queued and running batches, then the answers they leave: a request's
        answer is sent by its own task once its rows' results are in, after the batcher
        closed, so a host that returned then stopped the engine with them unsent."""
        await self.batcher.close()
        if self._answers:
            await asyncio.wait(set(self._answers))
