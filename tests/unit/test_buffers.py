"""The buffer pool: preallocation, slot reuse without allocation, miss counting."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import app.buffers as buffers_module
from app.buffers import BufferPool
from app.execute import execute_batch
from app.scheduler import BatchPolicy, BatchShape

POLICY = BatchPolicy(length_buckets=(8, 16), max_batch_size=4, max_batch_tokens=64, max_wait_s=0)


class SumRunner:
    """A model stand-in whose output row is (sum of ids kept by the mask, token count)."""

    name = "sum"
    task = "embed"
    device = torch.device("cpu")
    dtype = torch.bfloat16
    max_input_tokens = 16
    output_width = 2
    pad_token_id = 0

    def tokenize(self, texts: list[str], truncate: bool) -> list[list[int]]:
        return [[len(t)] for t in texts]

    def __init__(self) -> None:
        self.input_addresses: list[tuple[int, int]] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.input_addresses.append((input_ids.data_ptr(), attention_mask.data_ptr()))
        kept = input_ids * attention_mask
        return torch.stack([kept.sum(dim=1), attention_mask.sum(dim=1)], dim=1).float()


def make_pool(slots_per_shape: int = 1) -> BufferPool:
    return BufferPool(POLICY.shapes(), 2, torch.device("cpu"), slots_per_shape)


@pytest.fixture
def slot_constructions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BatchShape]]:
    """Records every BufferSlot built (each one allocates tensors)."""
    built: list[BatchShape] = []
    original = buffers_module.BufferSlot.__init__

    def recording_init(self: buffers_module.BufferSlot, shape: BatchShape, *args: object,
                       **kwargs: object) -> None:  # fmt: skip
        built.append(shape)
        original(self, shape, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(buffers_module.BufferSlot, "__init__", recording_init)
    yield built


def test_every_shape_is_preallocated_with_fp32_outputs() -> None:
    pool = make_pool(slots_per_shape=2)
    stats = pool.stats()
    assert set(stats.slots) == set(POLICY.shapes())
    assert all(count == 2 for count in stats.slots.values())
    assert stats.bytes_preallocated > 0
    slot, _ = pool.acquire(BatchShape(4, 16))
    assert slot.output.dtype == torch.float32
    assert slot.input_ids.shape == (4, 16)


def test_the_hot_path_reuses_slots_and_allocates_none(slot_constructions: list[BatchShape]) -> None:
    pool = make_pool()
    built_at_start = len(slot_constructions)
    shape = BatchShape(4, 8)
    first, _ = pool.acquire(shape)
    addresses = first.data_pointers()
    pool.release(first)
    runner = SumRunner()
    for _ in range(50):
        output = execute_batch(pool, runner, shape, [[1, 2, 3], [4]], stream=None)
        assert output.rows.tolist() == [[6.0, 3.0], [4.0, 1.0]]
        assert not output.timings.pool_miss
    # The model read every batch from the slot's own preallocated input tensors (not from
    # tensors built per batch), and no buffer of the slot was replaced.
    preallocated_inputs = (first.input_ids.data_ptr(), first.attention_mask.data_ptr())
    assert set(runner.input_addresses) == {preallocated_inputs}
    again, _ = pool.acquire(shape)
    assert again is first and again.data_pointers() == addresses
    assert len(slot_constructions) == built_at_start
    assert pool.stats().misses == 0


def test_padding_rows_never_leak_into_results() -> None:
    pool = make_pool()
    execute_batch(pool, SumRunner(), BatchShape(4, 8), [[9] * 8] * 4, stream=None)
    output = execute_batch(pool, SumRunner(), BatchShape(4, 8), [[1]], stream=None)
    assert output.rows.tolist() == [[1.0, 1.0]]


def test_a_shape_without_a_slot_is_served_and_counted_as_a_miss(
    slot_constructions: list[BatchShape],
) -> None:
    pool = make_pool()
    before = len(slot_constructions)
    output = execute_batch(pool, SumRunner(), BatchShape(3, 8), [[5], [6], [7]], stream=None)
    assert output.timings.pool_miss
    assert output.rows[:, 0].tolist() == [5.0, 6.0, 7.0]
    assert pool.stats().misses == 1
    assert len(slot_constructions) == before + 1
    assert pool.stats().slots.get(BatchShape(3, 8)) is None


def test_acquire_waits_for_a_busy_slot_and_counts_the_wait() -> None:
    pool = make_pool()
    shape = BatchShape(2, 8)
    held, _ = pool.acquire(shape)
    released = threading.Event()
    got: list[tuple[object, float, bool]] = []

    def wait_for_a_slot() -> None:
        slot, waited = pool.acquire(shape)
        got.append((slot, waited, released.is_set()))

    # Daemon: a waiter blocked for good (a release that never notifies) must not keep the
    # interpreter, and so pytest, from exiting.
    waiter = threading.Thread(target=wait_for_a_slot, daemon=True)
    waiter.start()
    # The waiter is blocked until the slot comes back; the wait counter proves it queued
    # (bounded: a pool that never counts the wait fails here instead of hanging).
    give_up_at = time.monotonic() + 30
    while pool.stats().acquire_waits == 0:
        assert time.monotonic() < give_up_at, "the waiter never queued for the slot"
        threading.Event().wait(0.001)
    assert pool.stats().in_use[shape] == 1
    released.set()
    pool.release(held)
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "the released slot never reached the waiter"
    assert len(got) == 1
    slot, waited, after_release = got[0]
    assert slot is held  # the one slot came back to the waiter, none was made for it
    assert after_release  # it was handed over only once released
    assert waited > 0.0  # and the wait it reports is the time it spent blocked


def test_the_slot_device_not_the_stream_decides_the_path() -> None:
    # A stream handed to a CPU slot (a CUDA build, a thread set up for the GPU) must not send
    # the batch down the CUDA path.
    pool = make_pool()
    not_a_cpu_stream: Any = object()
    output = execute_batch(pool, SumRunner(), BatchShape(2, 8), [[2, 3]], not_a_cpu_stream)
    assert output.rows.tolist() == [[5.0, 2.0]]


def test_a_released_slot_reaches_its_waiter_behind_a_waiter_for_another_shape() -> None:
    """One condition serves every shape: `notify()` woke the first waiter, which waited for
    the other shape and slept again, and the waiter for the released slot stayed blocked
    with its slot free (a compute thread held, its batch late)."""
    pool = make_pool()
    first, second = BatchShape(2, 8), BatchShape(4, 8)
    held_first, _ = pool.acquire(first)
    held_second, _ = pool.acquire(second)
    got: dict[BatchShape, object] = {}

    def wait_for(shape: BatchShape) -> None:
        got[shape] = pool.acquire(shape)[0]

    waiters = []
    for waits in (1, 2):  # the waiter for `second` queues first, then the one for `first`
        shape = second if waits == 1 else first
        waiters.append(threading.Thread(target=wait_for, args=(shape,), daemon=True))
        waiters[-1].start()
        give_up_at = time.monotonic() + 30
        while pool.stats().acquire_waits < waits:
            assert time.monotonic() < give_up_at, "a waiter never queued"
            threading.Event().wait(0.001)
    pool.release(held_first)
    waiters[1].join(timeout=10)
    assert got.get(first) is held_first
    pool.release(held_second)
    waiters[0].join(timeout=10)
    assert got.get(second) is held_second
