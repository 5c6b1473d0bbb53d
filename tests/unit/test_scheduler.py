"""The batching policy, driven by hand with an injected clock (no asyncio, no torch)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from app.scheduler import (
    BatchPolicy,
    BatchShape,
    CloseReason,
    Scheduler,
    WorkItem,
    batch_buckets,
)

POLICY = BatchPolicy(
    length_buckets=(16, 32, 64, 128),
    max_batch_size=8,
    max_batch_tokens=256,
    max_wait_s=0.005,
)
_ids = itertools.count()


def item(n_tokens: int, at: float, deadline: float = 100.0) -> WorkItem:
    bucket = POLICY.length_bucket_for(n_tokens)
    assert bucket is not None
    return WorkItem(next(_ids), n_tokens, bucket, enqueued_at=at, deadline=deadline)


def test_inputs_go_to_the_smallest_length_bucket_that_holds_them() -> None:
    assert POLICY.length_bucket_for(1) == 16
    assert POLICY.length_bucket_for(16) == 16
    assert POLICY.length_bucket_for(17) == 32
    assert POLICY.length_bucket_for(128) == 128
    assert POLICY.length_bucket_for(129) is None


def test_batch_buckets_are_powers_of_two_capped_by_rows_and_tokens() -> None:
    assert batch_buckets(32, 4096, 16) == (1, 2, 4, 8, 16, 32)
    assert batch_buckets(32, 4096, 512) == (1, 2, 4, 8)
    assert batch_buckets(24, 4096, 16) == (1, 2, 4, 8, 16, 24)
    assert batch_buckets(32, 100, 64) == (1,)
    # Long buckets get smaller batches under the token cap.
    assert POLICY.batch_buckets(16) == (1, 2, 4, 8)
    assert POLICY.batch_buckets(64) == (1, 2, 4)
    assert POLICY.batch_buckets(128) == (1, 2)


def test_shapes_cover_every_length_and_batch_bucket() -> None:
    shapes = POLICY.shapes()
    assert BatchShape(8, 16) in shapes
    assert BatchShape(2, 128) in shapes
    assert BatchShape(4, 128) not in shapes
    assert len(shapes) == len(set(shapes)) == 4 + 4 + 3 + 2


def test_a_full_bucket_closes_at_once_and_is_not_padded() -> None:
    scheduler = Scheduler(POLICY)
    for _ in range(8):
        scheduler.enqueue(item(10, at=0.0))
    decision = scheduler.poll(now=0.0)
    assert decision.batch is not None
    assert decision.batch.reason is CloseReason.FULL
    assert decision.batch.shape == BatchShape(8, 16)
    assert len(decision.batch.items) == 8
    assert scheduler.depth == 0


def test_a_partial_batch_waits_for_max_wait_then_is_padded_to_a_batch_bucket() -> None:
    scheduler = Scheduler(POLICY)
    for _ in range(3):
        scheduler.enqueue(item(20, at=1.000))
    waiting = scheduler.poll(now=1.001)
    assert waiting.batch is None
    assert waiting.wake_at == pytest.approx(1.005)
    closed = scheduler.poll(now=1.005)
    assert closed.batch is not None
    assert closed.batch.reason is CloseReason.MAX_WAIT
    assert closed.batch.shape == BatchShape(4, 32)
    assert len(closed.batch.items) == 3


def test_more_than_a_batch_leaves_the_rest_queued_in_arrival_order() -> None:
    scheduler = Scheduler(POLICY)
    queued = [item(5, at=0.001 * i) for i in range(11)]
    for entry in queued:
        scheduler.enqueue(entry)
    first = scheduler.poll(now=0.011).batch
    assert first is not None
    assert [i.item_id for i in first.items] == [i.item_id for i in queued[:8]]
    assert scheduler.depth == 3
    second = scheduler.poll(now=0.020).batch
    assert second is not None
    assert [i.item_id for i in second.items] == [i.item_id for i in queued[8:]]


def test_an_urgent_deadline_closes_the_batch_before_max_wait() -> None:
    scheduler = Scheduler(POLICY)
    scheduler.record_compute(BatchShape(2, 16), 0.010)
    scheduler.enqueue(item(5, at=0.0, deadline=1.0))
    scheduler.enqueue(item(5, at=0.0, deadline=0.012))
    # max_wait would close at 0.005; the deadline needs the 10 ms batch to start by 0.002.
    assert scheduler.poll(now=0.001).wake_at == pytest.approx(0.002)
    decision = scheduler.poll(now=0.002)
    assert decision.batch is not None
    assert decision.batch.reason is CloseReason.DEADLINE


def test_earliest_deadlines_are_taken_first_when_a_bucket_overflows() -> None:
    scheduler = Scheduler(POLICY)
    relaxed = [item(5, at=0.0, deadline=10.0) for _ in range(8)]
    urgent = item(5, at=0.001, deadline=0.5)
    for entry in [*relaxed, urgent]:
        scheduler.enqueue(entry)
    batch = scheduler.poll(now=0.002).batch
    assert batch is not None
    assert urgent.item_id in {i.item_id for i in batch.items}
    assert relaxed[-1].item_id not in {i.item_id for i in batch.items}


def test_expired_inputs_are_dropped_before_they_take_a_slot() -> None:
    scheduler = Scheduler(POLICY)
    alive = item(5, at=0.0, deadline=5.0)
    dead = item(5, at=0.0, deadline=0.003)
    scheduler.enqueue(alive)
    scheduler.enqueue(dead)
    decision = scheduler.poll(now=0.006)
    assert [i.item_id for i in decision.expired] == [dead.item_id]
    assert decision.batch is not None
    assert [i.item_id for i in decision.batch.items] == [alive.item_id]
    assert decision.batch.shape == BatchShape(1, 16)


def test_inputs_that_cannot_finish_in_time_are_dropped_as_expired() -> None:
    scheduler = Scheduler(POLICY)
    scheduler.record_compute(BatchShape(1, 16), 0.050)
    hopeless = item(5, at=0.0, deadline=0.030)
    scheduler.enqueue(hopeless)
    decision = scheduler.poll(now=0.001)
    assert [i.item_id for i in decision.expired] == [hopeless.item_id]
    assert decision.batch is None
    assert scheduler.depth == 0


def test_an_urgent_input_gets_a_batch_small_enough_for_its_deadline() -> None:
    """One input alone would make its 20 ms deadline (2 ms), but not in the 4-row batch
    (50 ms) its queue fills: the relaxed inputs go back to the queue, the urgent one runs.
    It used to be shed (504) while the relaxed ones ran."""
    scheduler = Scheduler(POLICY)
    scheduler.record_compute(BatchShape(1, 16), 0.002)
    scheduler.record_compute(BatchShape(2, 16), 0.030)
    scheduler.record_compute(BatchShape(4, 16), 0.050)
    relaxed = [item(5, at=0.0, deadline=1.0) for _ in range(3)]
    urgent = item(5, at=0.0, deadline=0.020)
    for entry in [*relaxed, urgent]:
        scheduler.enqueue(entry)
    decision = scheduler.poll(now=0.0)
    assert decision.expired == ()
    assert decision.batch is not None
    assert [i.item_id for i in decision.batch.items] == [urgent.item_id]
    assert scheduler.depth == 3  # the relaxed ones, queued for the next batch
    following = scheduler.poll(now=0.005)  # its max wait: the next batch closes
    assert following.batch is not None
    assert [i.item_id for i in following.batch.items] == [i.item_id for i in relaxed]


def test_a_batch_that_would_finish_late_runs_smaller_and_the_rest_runs_next() -> None:
    scheduler = Scheduler(POLICY)
    scheduler.record_compute(BatchShape(1, 16), 0.002)
    scheduler.record_compute(BatchShape(2, 16), 0.050)
    both = [item(5, at=0.0, deadline=0.020) for _ in range(2)]
    for entry in both:
        scheduler.enqueue(entry)
    decision = scheduler.poll(now=0.0)
    # Taken together they miss; one alone makes it (2 ms), then the other (by 7 ms).
    assert decision.batch is not None and len(decision.batch.items) == 1
    assert decision.batch.shape == BatchShape(1, 16)
    assert decision.expired == ()
    following = scheduler.poll(now=0.005)  # its max wait: the next batch closes
    assert following.batch is not None and len(following.batch.items) == 1
    assert following.expired == ()


def test_cancelled_inputs_are_dropped_and_reported() -> None:
    scheduler = Scheduler(POLICY)
    kept, gone = item(5, at=0.0), item(5, at=0.0)
    scheduler.enqueue(kept)
    scheduler.enqueue(gone)
    scheduler.cancel(gone.item_id)
    decision = scheduler.poll(now=0.010)
    assert [i.item_id for i in decision.cancelled] == [gone.item_id]
    assert decision.batch is not None
    assert [i.item_id for i in decision.batch.items] == [kept.item_id]
    assert scheduler.depth == 0


def test_withdraw_takes_out_only_the_inputs_still_queued_and_says_which() -> None:
    """A request's inputs across buckets: the one a batch already took stays that batch's
    (not withdrawn, not counted twice), the queued ones leave at once, whatever bucket,
    a cancelled one included, and an id the scheduler never saw is ignored."""
    scheduler = Scheduler(POLICY)
    other = [item(5, at=0.0) for _ in range(8)]
    in_batch = item(5, at=0.0)
    short, long, gone = item(5, at=0.1), item(40, at=0.1), item(5, at=0.1)
    for entry in [in_batch, *other, short, long, gone]:
        scheduler.enqueue(entry)
    batch = scheduler.poll(now=0.0).batch  # a full batch of the 16 bucket, `in_batch` first
    assert batch is not None and in_batch in batch.items
    scheduler.cancel(gone.item_id)
    request = [in_batch.item_id, short.item_id, long.item_id, gone.item_id, 10**9]
    withdrawn = scheduler.withdraw(request)
    assert {i.item_id for i in withdrawn} == {short.item_id, long.item_id, gone.item_id}
    assert scheduler.depth == 1 and scheduler.queued(64) == 0
    assert scheduler.withdraw(request) == ()  # nothing of it queued any more
    after = scheduler.poll(now=1.0)
    assert after.cancelled == () and after.batch is not None
    assert [i.item_id for i in after.batch.items] == [other[-1].item_id]
    assert scheduler.depth == 0
    scheduler.finished(batch)
    scheduler.finished(after.batch)
    assert scheduler.backlog_seconds(now=1.0) == 0.0


class _CountedQueues(dict[int, Any]):
    """A scheduler's queues that count how often they are walked."""

    walks = 0

    def items(self) -> Any:
        self.walks += 1
        return super().items()


def test_withdrawing_no_ids_walks_no_queue() -> None:
    """Every expiry of a one-input request withdrew its request's (no) other inputs: a
    walk of every queue each, O(expired x queued) per poll under overload."""
    scheduler = Scheduler(POLICY)
    for at in range(50):
        scheduler.enqueue(item(5, at=at))
    queues = _CountedQueues(scheduler._queues)
    scheduler._queues = queues
    assert scheduler.withdraw([]) == () and scheduler.withdraw(set()) == ()
    assert queues.walks == 0 and scheduler.depth == 50


def test_the_bucket_with_the_oldest_input_goes_first() -> None:
    scheduler = Scheduler(POLICY)
    scheduler.enqueue(item(100, at=0.000))
    scheduler.enqueue(item(5, at=0.001))
    first = scheduler.poll(now=0.010).batch
    assert first is not None and first.shape.length == 128
    second = scheduler.poll(now=0.010).batch
    assert second is not None and second.shape.length == 16


def test_compute_estimates_are_smoothed() -> None:
    scheduler = Scheduler(POLICY)
    shape = BatchShape(4, 32)
    assert scheduler.estimated_compute(shape) == 0.0
    scheduler.record_compute(shape, 0.010)
    scheduler.record_compute(shape, 0.020)
    assert 0.010 < scheduler.estimated_compute(shape) < 0.020


def test_an_empty_scheduler_has_nothing_to_do() -> None:
    decision = Scheduler(POLICY).poll(now=0.0)
    assert decision.batch is None and decision.wake_at is None


def test_expire_drops_only_dead_inputs_and_says_when_the_next_one_dies() -> None:
    scheduler = Scheduler(POLICY)
    scheduler.record_compute(BatchShape(1, 16), 0.010)
    dying = item(5, at=0.0, deadline=0.020)
    later = item(5, at=0.0, deadline=0.500)
    scheduler.enqueue(dying)
    scheduler.enqueue(later)
    first = scheduler.expire(now=0.001)
    assert first.batch is None and first.expired == ()
    assert first.wake_at == pytest.approx(0.010)
    second = scheduler.expire(now=0.010)
    assert [i.item_id for i in second.expired] == [dying.item_id]
    assert second.wake_at == pytest.approx(0.490)
    assert scheduler.depth == 1


def test_a_running_batch_whose_end_moves_counts_in_the_backlog_until_then() -> None:
    """A failed batch holds its compute slot while its rows run again one by one (the
    batcher's triage): once its estimate from `poll` ran out the backlog read that slot as
    free, and admission let in requests that waited behind the triage and ended 504."""
    scheduler = Scheduler(POLICY)
    scheduler.record_compute(BatchShape(4, 16), 0.040)
    for _ in range(3):
        scheduler.enqueue(item(5, at=0.0))
    batch = scheduler.poll(now=1.000).batch  # 3 rows padded to 4, estimated 40 ms
    assert batch is not None and batch.shape == BatchShape(4, 16)
    assert scheduler.backlog_seconds(now=1.040) == 0.0  # it failed, as estimated
    # Triage: a known-good row and the three alone, 10 ms each, on the same slot.
    scheduler.runs_until(batch, 1.040 + 4 * 0.010)
    assert scheduler.backlog_seconds(now=1.040) == pytest.approx(0.040)
    assert scheduler.backlog_seconds(now=1.050) == pytest.approx(0.030)
    scheduler.runs_until(batch, 1.065 + 2 * 0.010)  # two runs done, slower than estimated
    assert scheduler.backlog_seconds(now=1.065) == pytest.approx(0.020)
    scheduler.finished(batch)
    assert scheduler.backlog_seconds(now=1.065) == 0.0
    scheduler.runs_until(batch, 2.000)  # ended: no longer running, nothing to count
    assert scheduler.backlog_seconds(now=1.065) == 0.0
