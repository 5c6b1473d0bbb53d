"""The blocking body of one batch: acquire a slot, copy in, run, copy out, release, timed
(`run_in_slot`, for every slot pool: token ids here, tensors in `tensor_batch.py`); and a
token-input batch's own steps, split in halves when the device runs out of memory.

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

from app.buffers import BufferPool, BufferSlot, SlotPool, SlotT
from app.models.base import ModelRunner
from app.scheduler import BatchShape
from app.telemetry.schedstat import thread_runqueue_wait_s

log = logging.getLogger(__name__)


ResultT = TypeVar("ResultT")


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
) -> tuple[ResultT, SlotTimings]:
    """Acquire a slot of `shape`, copy the batch in, run it, copy its result out (owned by
    the caller) and release the slot, whatever happens; with the timings of each step."""
    slot, waited = pool.acquire(shape)
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

    def row(self, index: int) -> npt.NDArray[np.float32]:
        """One input's output vector (a view of `rows`)."""
        row: npt.NDArray[np.float32] = self.rows[index]
        return row


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
    """Run `token_ids` (at most `shape.batch` rows, each at most `shape.length` tokens)."""
    rows, timings = run_in_slot(
        pool,
        shape,
        lambda slot: slot.write_inputs(token_ids, runner.pad_token_id),
        lambda slot: _run_on_slot(runner, slot, stream),
        lambda slot: slot.output_view[: len(token_ids)].copy(),
    )
    return BatchOutput(rows, timings)


def run_batch(
    pool: BufferPool,
    runner: ModelRunner,
    shape: BatchShape,
    token_ids: Sequence[list[int]],
    stream: torch.cuda.Stream | None,
    shape_for_rows: Callable[[int], BatchShape],
) -> BatchOutput:
    """`execute_batch`, but out of device memory the batch is split in halves (each in the
    shape `shape_for_rows` gives) instead of failing every request in it."""
    try:
        return execute_batch(pool, runner, shape, token_ids, stream)
    except torch.OutOfMemoryError:
        if len(token_ids) == 1:
            raise
        log.warning("%s: out of memory at %s; splitting the batch", runner.name, shape)
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
    half = len(token_ids) // 2
    parts = [
        run_batch(pool, runner, shape_for_rows(len(rows)), rows, stream, shape_for_rows)
        for rows in (token_ids[:half], token_ids[half:])
    ]
    return BatchOutput(
        np.concatenate([p.rows for p in parts]), SlotTimings.total(p.timings for p in parts)
    )


def warmup_token_ids(shape: BatchShape, filler_token_id: int) -> list[list[int]]:
    """Full rows of a shape, so warm-up exercises exactly the shape traffic will use."""
    return [[filler_token_id] * shape.length for _ in range(shape.batch)]
