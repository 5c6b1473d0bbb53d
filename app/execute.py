"""The blocking body of one batch: acquire a slot, copy in, run, copy out, release, timed
(`run_in_slot`, for every slot pool: token ids here, tensors in `tensor_batch.py`); a batch
split in halves where an allocation failed (`split_on_allocation_failure`, for both); and a
token-input batch's own steps, its rows with a NaN or infinity found on the way out.

Runs on a dispatcher compute thread only. On CUDA the copies are non-blocking on the
thread's own stream (to and from pinned host buffers) and the thread waits for its stream
alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import torch

from app.batch_triage import allocation_failed
from app.buffers import BufferPool, BufferSlot, SlotPool, SlotT
from app.models.base import ModelRunner
from app.scheduler import BatchShape
from app.telemetry.schedstat import thread_runqueue_wait_s

log = logging.getLogger(__name__)


ResultT = TypeVar("ResultT")
RowT = TypeVar("RowT")


@dataclass(frozen=True, slots=True)
class SlotTimings:
    """How one batch went: `compute_s` is copy in + run + copy out, after `acquire_wait_s`
    waiting for a slot (`pool_miss`: none was preallocated for its shape)."""

    compute_s: float
    acquire_wait_s: float
    pool_miss: bool
    # The split of compute_s (on CUDA the device copies are inside run_s: they are queued
    # on the thread's stream with the forward pass), and how long this thread waited,
    # runnable, for a CPU meanwhile (taken by other threads or processes).
    copy_in_s: float = 0.0
    run_s: float = 0.0
    copy_out_s: float = 0.0
    runqueue_wait_s: float = 0.0

    @staticmethod
    def total(parts: Iterable[SlotTimings]) -> SlotTimings:
        """The timings of batches run one after the other as one (a split batch's)."""
        parts = list(parts)
        return SlotTimings(
            compute_s=sum(p.compute_s for p in parts),
            acquire_wait_s=sum(p.acquire_wait_s for p in parts),
            pool_miss=any(p.pool_miss for p in parts),
            copy_in_s=sum(p.copy_in_s for p in parts),
            run_s=sum(p.run_s for p in parts),
            copy_out_s=sum(p.copy_out_s for p in parts),
            runqueue_wait_s=sum(p.runqueue_wait_s for p in parts),
        )


def run_in_slot(
    pool: SlotPool[SlotT],
    shape: BatchShape,
    copy_in: Callable[[SlotT], object],
    run: Callable[[SlotT], object],
    copy_out: Callable[[SlotT], ResultT],
    stream: torch.cuda.Stream | None,
) -> tuple[ResultT, SlotTimings]:
    """Acquire a slot of `shape` (a miss's made on `stream`, the one `run` uses: see
    `SlotPool.acquire`), copy the batch in, run it, copy its result out (owned by the
    caller) and release the slot, whatever happens; with the timings of each step."""
    slot, waited = pool.acquire(shape, stream)
    try:
        started, waited_before = time.perf_counter(), thread_runqueue_wait_s()
        copy_in(slot)
        copied_in = time.perf_counter()
        run(slot)
        ran = time.perf_counter()
        result = copy_out(slot)
        finished = time.perf_counter()
        return result, SlotTimings(
            finished - started,
            waited,
            slot.is_fallback,
            copy_in_s=copied_in - started,
            run_s=ran - copied_in,
            copy_out_s=finished - ran,
            runqueue_wait_s=thread_runqueue_wait_s() - waited_before,
        )
    finally:
        pool.release(slot)


@dataclass(frozen=True, slots=True)
class BatchOutput:
    rows: npt.NDArray[np.float32]  # (inputs, output_width), owned by the caller
    timings: SlotTimings
    # The rows holding a NaN or an infinity (`non_finite_rows`): not answerable.
    non_finite: tuple[int, ...] = ()

    def row(self, index: int) -> npt.NDArray[np.float32]:
        """One input's output vector (a view of `rows`)."""
        row: npt.NDArray[np.float32] = self.rows[index]
        return row

    @staticmethod
    def joined(first: BatchOutput, second: BatchOutput) -> BatchOutput:
        """The output of `first`'s rows then `second`'s, run one after the other."""
        offset = len(first.rows)
        return BatchOutput(
            np.concatenate([first.rows, second.rows]),
            SlotTimings.total((first.timings, second.timings)),
            first.non_finite + tuple(offset + index for index in second.non_finite),
        )


def non_finite_rows(rows: npt.NDArray[np.float32]) -> tuple[int, ...]:
    """The indices of the rows holding a NaN or an infinity: one pass over the batch's
    outputs, on its compute thread (a 64 x 384 float32 batch in about 12 us, its copy out
    of the slot 8 us; a reduction per row, `all(axis=1)`, took 21 us: only where one is not
    finite)."""
    finite = np.isfinite(rows)
    if finite.all():
        return ()
    return tuple(int(index) for index in np.flatnonzero(~finite.all(axis=1)))


def _run_on_slot(runner: ModelRunner, slot: BufferSlot, stream: torch.cuda.Stream | None) -> None:
    # The slot's device decides the path (a stream handed to a CPU slot is ignored; a CUDA
    # slot without one runs on the device's current stream).
    if slot.output.device.type != "cuda":
        slot.output.copy_(runner.forward(slot.input_ids, slot.attention_mask))
        return
    if stream is None:
        stream = torch.cuda.current_stream(slot.output.device)
    try:
        with torch.cuda.stream(stream):
            slot.input_ids.copy_(slot.host_input_ids, non_blocking=True)
            slot.attention_mask.copy_(slot.host_attention_mask, non_blocking=True)
            slot.output.copy_(runner.forward(slot.input_ids, slot.attention_mask))
            slot.host_output.copy_(slot.output, non_blocking=True)
    finally:
        # Wait for this thread's stream only (other threads' batches keep running), and
        # always, so that no copy into the slot is still in flight once it is released.
        stream.synchronize()


def execute_batch(
    pool: BufferPool,
    runner: ModelRunner,
    shape: BatchShape,
    token_ids: Sequence[list[int]],
    stream: torch.cuda.Stream | None,
) -> BatchOutput:
    """Run `token_ids` (at most `shape.batch` rows, each at most `shape.length` tokens);
    its rows with a NaN or an infinity are found once the slot is back."""
    rows, timings = run_in_slot(
        pool,
        shape,
        lambda slot: slot.write_inputs(token_ids, runner.pad_token_id),
        lambda slot: _run_on_slot(runner, slot, stream),
        lambda slot: slot.output_view[: len(token_ids)].copy(),
        stream,
    )
    return BatchOutput(rows, timings, non_finite_rows(rows))


def split_on_allocation_failure(
    name: str,
    device: torch.device,
    shape: BatchShape,
    rows: Sequence[RowT],
    execute: Callable[[BatchShape, Sequence[RowT]], ResultT],
    shape_for_rows: Callable[[int], BatchShape],
    join: Callable[[ResultT, ResultT], ResultT],
) -> ResultT:
    """`execute(shape, rows)`, but where an allocation failed (`allocation_failed`: torch's
    `OutOfMemoryError`, and its words for one in a plain `RuntimeError`: "CUDA error: out of
    memory", CUBLAS_STATUS_ALLOC_FAILED, the CPU allocator's "can't allocate memory", also
    wrapped by a model library) the rows are split in halves, each run the same way in the
    shape `shape_for_rows` gives, and their outputs joined (`join`), instead of failing
    every request in the batch: only a row alone that cannot be allocated raises."""
    try:
        return execute(shape, rows)
    except Exception as error:
        if len(rows) == 1 or not allocation_failed(error):
            raise
        log.warning(
            "%s: out of memory at %s (%s); splitting the batch", name, shape, type(error).__name__
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    half = len(rows) // 2
    first, second = [
        split_on_allocation_failure(
            name, device, shape_for_rows(len(part)), part, execute, shape_for_rows, join
        )
        for part in (rows[:half], rows[half:])
    ]
    return join(first, second)


def run_batch(
    pool: BufferPool,
    runner: ModelRunner,
    shape: BatchShape,
    token_ids: Sequence[list[int]],
    stream: torch.cuda.Stream | None,
    shape_for_rows: Callable[[int], BatchShape],
) -> BatchOutput:
    """`execute_batch`, split in halves where an allocation failed (each half in the shape
    `shape_for_rows` gives: `split_on_allocation_failure`)."""
    return split_on_allocation_failure(
        runner.name,
        runner.device,
        shape,
        token_ids,
        lambda shape, rows: execute_batch(pool, runner, shape, rows, stream),
        shape_for_rows,
        BatchOutput.joined,
    )


def warmup_token_ids(shape: BatchShape, filler_token_id: int) -> list[list[int]]:
    """Full rows of a shape, so warm-up exercises exactly the shape traffic will use."""
    return [[filler_token_id] * shape.length for _ in range(shape.batch)]
