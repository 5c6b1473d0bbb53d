"""BufferPool: preallocated fixed-shape tensors that batches are copied into.

Variable-length inputs allocating fresh tensors per request fragment the CUDA caching
allocator (one of the field incidents). Here every (batch bucket x length bucket) shape gets
its slots at start-up: device input buffers (token ids, attention mask), an fp32 device
output buffer, and host staging buffers (pinned on CUDA) that the tokenized inputs are
written into and the outputs are read back from. Outputs stay fp32 whatever the model's
dtype: pooling accumulates in fp32, and one pooled row per input is cheap to keep whole
(rounding it to fp16/bf16 would cost 3-4 significant digits for no gain). A batch acquires
a slot, is copied into it, runs, is copied out, and releases the slot: no per-request
tensor allocation for inputs and outputs. A shape without a slot is served by a temporary,
counted slot (a *miss*).

`acquire` and `release` are thread-safe and are called from dispatcher threads only
(`acquire` may block while every slot of a shape is busy).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from app.scheduler import BatchShape


@dataclass(frozen=True, slots=True)
class PoolStats:
    slots: dict[BatchShape, int]
    in_use: dict[BatchShape, int]
    misses: int
    acquire_waits: int
    bytes_preallocated: int


class BufferSlot:
    """The tensors of one preallocated (or fallback) shape. Owned by one batch at a time."""

    def __init__(
        self,
        shape: BatchShape,
        output_width: int,
        device: torch.device,
        is_fallback: bool = False,
    ) -> None:
        self.shape = shape
        self.is_fallback = is_fallback
        rows, length = shape.batch, shape.length
        on_cuda = device.type == "cuda"
        # Host staging: written by numpy views (no torch allocation per batch); pinned on
        # CUDA so the host-to-device copy can be asynchronous on the dispatcher's stream.
        self.host_input_ids = torch.zeros((rows, length), dtype=torch.int64, pin_memory=on_cuda)
        self.host_attention_mask = torch.zeros(
            (rows, length), dtype=torch.int64, pin_memory=on_cuda
        )
        self.host_output = torch.zeros(
            (rows, output_width), dtype=torch.float32, pin_memory=on_cuda
        )
        if on_cuda:
            self.input_ids = torch.zeros((rows, length), dtype=torch.int64, device=device)
            self.attention_mask = torch.zeros((rows, length), dtype=torch.int64, device=device)
        else:
            # On the CPU the staging buffers are the model's inputs: no copy at all.
            self.input_ids = self.host_input_ids
            self.attention_mask = self.host_attention_mask
        # fp32 (see the module docstring); on the CPU the host buffer is the output itself.
        self.output = (
            torch.zeros((rows, output_width), dtype=torch.float32, device=device)
            if on_cuda
            else self.host_output
        )
        self.ids_view: npt.NDArray[np.int64] = self.host_input_ids.numpy()
        self.mask_view: npt.NDArray[np.int64] = self.host_attention_mask.numpy()
        self.output_view: npt.NDArray[np.float32] = self.host_output.numpy()

    @property
    def nbytes(self) -> int:
        tensors = {
            id(t): t
            for t in (
                self.host_input_ids,
                self.host_attention_mask,
                self.host_output,
                self.input_ids,
                self.attention_mask,
                self.output,
            )
        }
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def data_pointers(self) -> tuple[int, ...]:
        """Addresses of every buffer: unchanged for a slot's life (tests check no re-allocation)."""
        tensors = (
            self.host_input_ids,
            self.host_attention_mask,
            self.input_ids,
            self.attention_mask,
            self.output,
            self.host_output,
        )
        return tuple(t.data_ptr() for t in tensors)

    def write_inputs(self, token_ids: Iterable[list[int]], pad_token_id: int) -> int:
        """Copy tokenized inputs into the host staging buffers, padding rows and columns.

        Rows beyond the batch's inputs get a single pad token with mask 1, so attention never
        sees an all-masked row (which some kernels turn into NaN). Returns the rows written.
        """
        ids, mask = self.ids_view, self.mask_view
        ids.fill(pad_token_id)
        mask.fill(0)
        rows = 0
        for row, sequence in enumerate(token_ids):
            ids[row, : len(sequence)] = sequence
            mask[row, : len(sequence)] = 1
            rows += 1
        mask[rows:, 0] = 1
        return rows


class Slot(Protocol):
    """What a pool needs of its slots."""

    @property
    def shape(self) -> BatchShape: ...
    @property
    def is_fallback(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...


SlotT = TypeVar("SlotT", bound=Slot)


class SlotPool(Generic[SlotT]):
    """Slots per shape, made by `make_slot(shape, is_fallback)` at construction; see the
    module docstring."""

    def __init__(
        self,
        shapes: Iterable[BatchShape],
        make_slot: Callable[[BatchShape, bool], SlotT],
        device: torch.device,
        slots_per_shape: int,
    ) -> None:
        self.device = device
        self._make_slot = make_slot
        self._free: dict[BatchShape, list[SlotT]] = {}
        self._total: dict[BatchShape, int] = {}
        for shape in shapes:
            self._free[shape] = [make_slot(shape, False) for _ in range(slots_per_shape)]
            self._total[shape] = slots_per_shape
        self.bytes_preallocated = sum(s.nbytes for slots in self._free.values() for s in slots)
        if device.type == "cuda":
            # The zero-fills above ran on this thread's current stream; batches run on the
            # compute threads' own streams, which do not wait for it: finish them now.
            torch.cuda.synchronize(device)
        self._condition = threading.Condition()
        self._misses = 0
        self._acquire_waits = 0

    def acquire(
        self, shape: BatchShape, stream: torch.cuda.Stream | None = None
    ) -> tuple[SlotT, float]:
        """A slot for `shape` and the seconds spent waiting for it (dispatcher threads only).

        A miss's temporary slot is made on `stream`, the one its batch's copies and forward
        pass run on (None: the thread's current stream): made on another stream (the
        default), its device tensors' zero fills were unordered with the batch's
        non-blocking copies in, and a late fill could zero the inputs after them; and the
        caching allocator would hand it memory that was only free on that other stream."""
        with self._condition:
            free = self._free.get(shape)
            if free is None:
                self._misses += 1
                with torch.cuda.stream(stream):
                    return self._make_slot(shape, True), 0.0
            if free:
                return free.pop(), 0.0
            self._acquire_waits += 1
            started = time.perf_counter()
            self._condition.wait_for(lambda: bool(free))
            return free.pop(), time.perf_counter() - started

    def release(self, slot: SlotT) -> None:
        if slot.is_fallback:
            return
        with self._condition:
            self._free[slot.shape].append(slot)
            # Every waiter: one condition serves every shape, and the first waiter may want
            # another shape's slot (notify() woke it alone, and the waiter for this one slept
            # on with its slot free).
            self._condition.notify_all()

    def stats(self) -> PoolStats:
        with self._condition:
            return PoolStats(
                slots=dict(self._total),
                in_use={s: self._total[s] - len(f) for s, f in self._free.items()},
                misses=self._misses,
                acquire_waits=self._acquire_waits,
                bytes_preallocated=self.bytes_preallocated,
            )


class BufferPool(SlotPool[BufferSlot]):
    """The pool of a token-input model: `BufferSlot`s of `output_width` fp32 outputs."""

    def __init__(
        self,
        shapes: Iterable[BatchShape],
        output_width: int,
        device: torch.device,
        slots_per_shape: int,
    ) -> None:
        self.output_width = output_width
        super().__init__(
            shapes,
            lambda shape, is_fallback: BufferSlot(shape, output_width, device, is_fallback),
            device,
            slots_per_shape,
        )
