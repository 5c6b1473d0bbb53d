"""What a computed batch leaves behind: its metrics, and each input's `ItemResult` (its
answer, its waits, and the `BatchTrace` it carries into a slow-request report:
docs/SPIKES.md).

`ComputedBatch` is what a batch executor returns (`batcher.BatchExecutor`). Pure functions
of a batch and its output; the batcher calls them on the engine's event loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from app.engine.protocol import BatchTrace
from app.execute import SlotTimings
from app.metrics import Metrics
from app.scheduler import Batch

OutT = TypeVar("OutT")
OutT_co = TypeVar("OutT_co", covariant=True)


@dataclass(frozen=True, slots=True)
class ItemResult(Generic[OutT]):
    """One input's answer from its batch (or its run alone): the value, its wait in the
    queue, its time since, and its batch's trace."""

    value: OutT
    queue_wait_s: float
    compute_s: float
    batch: BatchTrace | None = None


class ComputedBatch(Protocol[OutT_co]):
    """What a batch executor returns (`execute.BatchOutput` for token inputs): each input's
    answer by row, and the batch's `execute.SlotTimings`."""

    @property
    def timings(self) -> SlotTimings: ...

    def row(self, index: int) -> OutT_co: ...


def record_batch_metrics(
    metrics: Metrics, model: str, batch: Batch, output: ComputedBatch[Any]
) -> None:
    """A computed batch's size, compute, slot wait and pool miss, by model (and bucket);
    the busy time and an unwarmed shape are the batcher's (every batch, failed or not)."""
    bucket, timings = str(batch.shape.length), output.timings
    metrics.batch_size.labels(model, bucket).observe(len(batch.items))
    metrics.batch_compute.labels(model, bucket).observe(timings.compute_s)
    metrics.pool_acquire_wait.labels(model).observe(timings.acquire_wait_s)
    if timings.pool_miss:
        metrics.pool_misses.labels(model).inc()


def batch_trace(
    batch: Batch,
    output: ComputedBatch[Any],
    expected_s: float,
    first_seen: bool,
    failed_batch_s: float = 0.0,
) -> BatchTrace:
    """The trace of `batch` as `output` computed it (for a row of a failed batch answered
    alone, `output` is its run alone and `failed_batch_s` the rest of its time)."""
    timings = output.timings
    return BatchTrace(
        rows=len(batch.items),
        padded_rows=batch.shape.batch,
        length_bucket=batch.shape.length,
        co_batched_lengths=[item.n_tokens for item in batch.items],
        acquire_wait_s=timings.acquire_wait_s,
        copy_in_s=timings.copy_in_s,
        run_s=timings.run_s,
        copy_out_s=timings.copy_out_s,
        expected_compute_s=expected_s,
        runqueue_wait_s=timings.runqueue_wait_s,
        first_seen_shape=first_seen,
        failed_batch_s=failed_batch_s,
    )
