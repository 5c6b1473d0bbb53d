"""What a poll, a wake and a withdraw cost in queued inputs: under overload on a GPU a model
queues hundreds to `max_queue` (4,096) inputs, and the scheduler used to scan them all,
several times per batch and per wake (`expire` on every wake while the compute slots were
busy, `_drop_dead` on every poll, a sort per batch, a walk of every bucket per withdraw).
Counted here as reads of the queued inputs' fields: the heaps of `app/bucket_queue.py` read
a few per input taken out, none per input left queued. The decisions themselves are the
old ones (tests/unit/test_scheduler_differential.py)."""

from __future__ import annotations

import random
from typing import Any, cast

import pytest

from app.scheduler import BatchPolicy, BatchShape, Scheduler, WorkItem

POLICY = BatchPolicy(
    length_buckets=(16, 64), max_batch_size=8, max_batch_tokens=512, max_wait_s=1.0
)
QUEUED = 4096


class Counted:
    """A queued input that counts every read of its fields (ids, times, lengths)."""

    reads = 0

    def __init__(self, item: WorkItem) -> None:
        self._item = item

    def __getattr__(self, name: str) -> Any:
        Counted.reads += 1
        return getattr(self._item, name)


def counted(item_id: int, bucket: int, deadline: float) -> WorkItem:
    item = WorkItem(item_id, bucket, bucket, enqueued_at=0.0, deadline=deadline)
    return cast(WorkItem, Counted(item))


def overloaded() -> Scheduler:
    """QUEUED inputs in the 16 bucket, deadlines 10 s to 14 s out, and one in the 64."""
    scheduler = Scheduler(POLICY)
    scheduler.record_compute(BatchShape(1, 16), 0.001)
    scheduler.record_compute(BatchShape(8, 16), 0.004)
    for item_id in range(QUEUED):
        scheduler.enqueue(counted(item_id, 16, 10.0 + (item_id * 7919 % QUEUED) / 1000))
    scheduler.enqueue(counted(QUEUED, 64, 20.0))
    return scheduler


def reads_of(action: Any) -> int:
    Counted.reads = 0
    action()
    return Counted.reads


def test_a_wake_with_nothing_due_reads_no_queued_input() -> None:
    """The batch loop's wake while every compute slot is busy (each batch end, cancel and
    expiry timer): it scanned the whole queue for the next expiry."""
    scheduler = overloaded()
    assert reads_of(lambda: scheduler.expire(now=1.0)) <= 4  # a liveness check per bucket
    assert scheduler.expire(now=1.0).wake_at == pytest.approx(9.999)
    assert reads_of(lambda: scheduler.ready_at(now=1.0)) <= 4
    assert scheduler.depth == QUEUED + 1


def test_a_batch_reads_its_own_inputs_not_the_queue() -> None:
    """A poll scanned every bucket for expiries and sorted the bucket by deadline."""
    scheduler = overloaded()
    reads = reads_of(lambda: scheduler.poll(now=1.0))
    assert reads <= 120  # a dozen per input of the 8-row batch, none per input left queued
    assert scheduler.depth == QUEUED + 1 - 8


def test_inputs_expiring_cost_their_own_reads_not_the_queues() -> None:
    scheduler = overloaded()
    # Deadlines 10.000 to 10.031 are within the 1 ms one input alone takes: 32 expire.
    assert reads_of(lambda: scheduler.expire(now=10.0305)) <= 32 * 6
    assert scheduler.depth == QUEUED + 1 - 32
    assert reads_of(lambda: scheduler.expire(now=10.0305)) <= 4


def test_a_cancel_or_a_withdraw_reads_only_the_inputs_it_takes_out() -> None:
    """A cancelled id made the next poll rebuild every bucket; a withdraw walked every
    bucket, even for ids no longer queued (as each expired input of a request asked)."""
    scheduler = overloaded()
    assert reads_of(lambda: scheduler.withdraw([5, 6, QUEUED, 10**9])) <= 20
    assert reads_of(lambda: scheduler.withdraw([5, 6, QUEUED])) == 0
    scheduler.cancel(7)
    scheduler.cancel(10**9)
    assert reads_of(lambda: scheduler.expire(now=1.0)) <= 10
    assert scheduler.depth == QUEUED - 3


def test_queues_stay_bounded_however_inputs_leave() -> None:
    """Inputs taken out from the middle of a queue (cancelled, withdrawn) leave stale heap
    entries behind, rebuilt away once they outnumber the live inputs."""
    rng = random.Random(0)
    scheduler = Scheduler(POLICY)
    queue = scheduler._queues[16]
    queued: list[int] = []
    for item_id in range(21_000):
        scheduler.enqueue(WorkItem(item_id, 5, 16, enqueued_at=0.0, deadline=50.0 + item_id))
        queued.append(item_id)
        if item_id < 1000:
            continue
        gone = queued.pop(rng.randrange(len(queued)))
        if item_id % 3:
            assert len(scheduler.withdraw([gone])) == 1
        else:
            scheduler.cancel(gone)
            assert len(scheduler.expire(now=0.0).cancelled) == 1
        assert scheduler.depth == len(queued) == 1000
        assert len(queue._by_arrival) <= 2 * 1000 + 32
        assert len(queue._by_deadline) <= 2 * 1000 + 32
    assert scheduler.poll(now=1.0).batch is not None  # 8 of the most urgent left


def test_an_id_is_queued_once_at_a_time() -> None:
    scheduler = Scheduler(POLICY)
    scheduler.enqueue(WorkItem(1, 5, 16, enqueued_at=0.0, deadline=5.0))
    with pytest.raises(ValueError, match="queued already"):
        scheduler.enqueue(WorkItem(1, 40, 64, enqueued_at=0.0, deadline=5.0))
    batch = scheduler.poll(now=1.0).batch  # its max wait
    assert batch is not None
    scheduler.enqueue(WorkItem(1, 5, 16, enqueued_at=1.0, deadline=5.0))  # out of the queue
    assert scheduler.depth == 1
