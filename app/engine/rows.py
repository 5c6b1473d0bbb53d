"""What every batched host does with a request's rows: admission by predicted delay, and
waiting for the rows' results (or answering why there are none).

Event loop thread only.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from app.admission import DelayEstimate, Rejected, RejectReason, delay_verdict
from app.batcher import ItemResult
from app.engine.host import Emit, EngineLoad
from app.engine.protocol import Failure, FailureKind, Submit
from app.failures import BatchFailed, DeadlineExceeded
from app.metrics import Metrics
from app.scheduler import BatchShape, Scheduler

OutT = TypeVar("OutT")


def admit_rows(
    scheduler: Scheduler, load: EngineLoad, rows: int, longest: int, deadline: float
) -> Rejected | None:
    """None to queue `rows` inputs (the longest `longest` tokens or elements long); else
    why not: the queue cap, or a predicted wait (the engine's backlog plus the request's
    own batch) over the delay budget or past its deadline. A request that fits no length
    bucket is let through: `submit` answers it 400."""
    if load.queued_inputs + rows > load.max_queue:
        return Rejected(
            RejectReason.QUEUE,
            f"{load.queued_inputs} inputs queued (cap {load.max_queue})",
            load.backlog_s,
        )
    policy = scheduler.policy
    bucket = policy.length_bucket_for(longest)
    if bucket is None:
        return None
    batch_rows = min(rows, policy.max_batch(bucket))
    own = scheduler.estimated_compute(BatchShape(policy.padded_batch(bucket, batch_rows), bucket))
    estimate = DelayEstimate(backlog_s=load.backlog_s, own_compute_s=own)
    return delay_verdict(estimate, deadline, load.now, load.max_queue_delay_s)


async def gather_rows(
    futures: list[asyncio.Future[ItemResult[OutT]]],
    request: Submit,
    emit: Emit,
    metrics: Metrics,
) -> list[ItemResult[OutT]] | None:
    """Every row's result, in order; or None once the request was answered with its
    failure (deadline passed in the queue, failed batch) or cancelled by its front end
    (which expects no answer; its queued rows are dropped)."""
    try:
        return await asyncio.gather(*futures)
    except asyncio.CancelledError:
        for future in futures:
            future.cancel()
        return None
    except DeadlineExceeded:
        metrics.rejected.labels(request.model, RejectReason.DEADLINE.value).inc()
        emit(Failure(request.request_id, FailureKind.DEADLINE, "deadline passed in the queue"))
        return None
    except BatchFailed as error:
        emit(Failure(request.request_id, FailureKind.FAILED, f"batch failed: {error}"))
        return None
