"""One batch of a `tensor` model: rows copied into a preallocated slot of the declared
dtypes and padded shape, run, copied out and sliced back to each row's own length.

A slot holds, per declared input and output, a (batch x padded dims) tensor of its
datatype: host staging (pinned on CUDA) viewed by numpy, and a device copy on CUDA (half
precision there where the spec says FP16/BF16). Dynamic dimensions are padded with zeros up
to the batch's length bucket; rows beyond the batch's inputs are all zeros.

`execute_tensor_batch` (and `run_tensor_batch`, which splits a batch in halves where an
allocation failed, as the embedding task's does) runs on dispatcher compute threads only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.buffers import SlotPool
from app.execute import SlotTimings, run_in_slot, split_on_allocation_failure
from app.model_specs import TensorSpec
from app.models.tensor import TORCH_DTYPES, TensorModel
from app.scheduler import BatchShape
from app.tensors import NUMPY_DTYPES, padded_dims

Array = npt.NDArray[Any]


@dataclass(frozen=True, slots=True)
class TensorRow:
    """One input row: an array per declared input, in spec order, without the batch
    dimension; `length` is its longest dynamic dimension (1 without any)."""

    arrays: tuple[Array, ...]
    length: int


def _region(row: int, dims: Sequence[int]) -> tuple[int | slice[int, int, None], ...]:
    """Index of the top-left `dims` of one row of a (batch x ...) array."""
    return (row, *(slice(0, size) for size in dims))


def _numpy_view(tensor: torch.Tensor) -> Array:
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its raw bits
        return tensor.view(torch.int16).numpy().view(np.uint16)
    view: Array = tensor.numpy()
    return view


class TensorSlot:
    """The tensors of one preallocated (or fallback) shape. Owned by one batch at a time."""

    def __init__(
        self,
        shape: BatchShape,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        device: torch.device,
        is_fallback: bool = False,
    ) -> None:
        self.shape = shape
        self.is_fallback = is_fallback
        on_cuda = device.type == "cuda"

        def host(spec: TensorSpec) -> torch.Tensor:
            dims = (shape.batch, *padded_dims(spec, shape.length))
            return torch.zeros(dims, dtype=TORCH_DTYPES[spec.datatype], pin_memory=on_cuda)

        self.host_inputs = [host(spec) for spec in inputs]
        self.host_outputs = [host(spec) for spec in outputs]
        # On the CPU the staging buffers are the model's own inputs and outputs: no copy.
        self.inputs = (
            [torch.zeros_like(t, device=device) for t in self.host_inputs]
            if on_cuda
            else self.host_inputs
        )
        self.outputs = (
            [torch.zeros_like(t, device=device) for t in self.host_outputs]
            if on_cuda
            else self.host_outputs
        )
        self.input_views = [_numpy_view(t) for t in self.host_inputs]
        self.output_views = [_numpy_view(t) for t in self.host_outputs]

    @property
    def nbytes(self) -> int:
        tensors = {id(t): t for t in (*self.host_inputs, *self.host_outputs)}
        tensors.update({id(t): t for t in (*self.inputs, *self.outputs)})
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def data_pointers(self) -> tuple[int, ...]:
        """Addresses of every buffer: unchanged for a slot's life."""
        tensors = (*self.host_inputs, *self.host_outputs, *self.inputs, *self.outputs)
        return tuple(t.data_ptr() for t in tensors)

    def write_rows(self, rows: Sequence[TensorRow]) -> None:
        """Zero the staging buffers, then copy each row into the top-left of its place."""
        for index, view in enumerate(self.input_views):
            view.fill(0)
            for row_index, row in enumerate(rows):
                array = row.arrays[index]
                view[_region(row_index, array.shape)] = array


TensorPool = SlotPool[TensorSlot]


def tensor_pool(
    model: TensorModel, shapes: Sequence[BatchShape], slots_per_shape: int
) -> TensorPool:
    """Preallocate every shape's slots (compute threads: it touches the device)."""
    return SlotPool(
        shapes,
        lambda shape, fallback: TensorSlot(
            shape, model.inputs, model.outputs, model.device, fallback
        ),
        model.device,
        slots_per_shape,
    )


@dataclass(frozen=True, slots=True)
class TensorBatchOutput:
    """Each row's outputs (spec order, dynamic dimensions sliced to the row's length) and
    the batch's timings."""

    rows: list[tuple[Array, ...]]
    timings: SlotTimings

    def row(self, index: int) -> tuple[Array, ...]:
        return self.rows[index]

    @staticmethod
    def joined(first: TensorBatchOutput, second: TensorBatchOutput) -> TensorBatchOutput:
        """The output of `first`'s rows then `second`'s, run one after the other."""
        return TensorBatchOutput(
            first.rows + second.rows, SlotTimings.total((first.timings, second.timings))
        )


def _run_on_slot(model: TensorModel, slot: TensorSlot, stream: torch.cuda.Stream | None) -> None:
    def run() -> None:
        results = model(slot.inputs)
        for spec, result, out in zip(model.outputs, results, slot.outputs, strict=True):
            if tuple(result.shape) != tuple(out.shape):
                raise ValueError(
                    f"{model.name}: output {spec.name!r} has shape {list(result.shape)}; "
                    f"its spec gives {list(out.shape)} for this batch"
                )
            # `copy_` would convert silently: float scores declared INT64 or BOOL lost
            # their fractions, and values past FP16's range became infinity.
            if result.dtype != out.dtype:
                raise ValueError(
                    f"{model.name}: output {spec.name!r} is {result.dtype}; its spec gives "
                    f"{spec.datatype} ({out.dtype})"
                )
            out.copy_(result)

    if slot.outputs[0].device.type != "cuda":
        run()
        return
    if stream is None:
        stream = torch.cuda.current_stream(slot.outputs[0].device)
    try:
        with torch.cuda.stream(stream):
            for device_input, host_input in zip(slot.inputs, slot.host_inputs, strict=True):
                device_input.copy_(host_input, non_blocking=True)
            run()
            for host_output, device_output in zip(slot.host_outputs, slot.outputs, strict=True):
                host_output.copy_(device_output, non_blocking=True)
    finally:
        # Always, so that no copy into the slot is in flight once it is released.
        stream.synchronize()


def execute_tensor_batch(
    pool: TensorPool,
    model: TensorModel,
    shape: BatchShape,
    rows: Sequence[TensorRow],
    stream: torch.cuda.Stream | None,
) -> TensorBatchOutput:
    """Run `rows` (at most `shape.batch`, none longer than `shape.length`)."""

    def copy_out(slot: TensorSlot) -> list[tuple[Array, ...]]:
        return [
            tuple(
                view[_region(index, padded_dims(spec, row.length))].copy()
                for spec, view in zip(model.outputs, slot.output_views, strict=True)
            )
            for index, row in enumerate(rows)
        ]

    answers, timings = run_in_slot(
        pool,
        shape,
        lambda slot: slot.write_rows(rows),
        lambda slot: _run_on_slot(model, slot, stream),
        copy_out,
        stream,
    )
    return TensorBatchOutput(answers, timings)


def run_tensor_batch(
    pool: TensorPool,
    model: TensorModel,
    shape: BatchShape,
    rows: Sequence[TensorRow],
    stream: torch.cuda.Stream | None,
    shape_for_rows: Callable[[int], BatchShape],
) -> TensorBatchOutput:
    """`execute_tensor_batch`, split in halves where an allocation failed (each half in the
    shape `shape_for_rows` gives: `execute.split_on_allocation_failure`)."""
    return split_on_allocation_failure(
        model.name,
        model.device,
        shape,
        rows,
        lambda shape, rows: execute_tensor_batch(pool, model, shape, rows, stream),
        shape_for_rows,
        TensorBatchOutput.joined,
    )


def warmup_rows(model: TensorModel, shape: BatchShape) -> list[TensorRow]:
    """Full rows of zeros of a shape, so warm-up runs exactly the shapes traffic will."""
    row = TensorRow(
        tuple(
            np.zeros(padded_dims(spec, shape.length), dtype=NUMPY_DTYPES[spec.datatype])
            for spec in model.inputs
        ),
        shape.length,
    )
    return [row] * shape.batch
