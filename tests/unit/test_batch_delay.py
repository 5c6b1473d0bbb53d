"""The wait predicted for a request from the engine's published queue: the running batch,
the full batches ahead of it and its own (`app/admission.py::batch_delay`), and the verdict
on it. Pure."""

from __future__ import annotations

import pytest

from app.admission import BatchQueue, RejectReason, batch_delay, delay_verdict


# Batches of 32 rows computing in 32 ms (1 ms per input); one compute thread.
def _queue(backlog_s: float, queued: int) -> BatchQueue:
    return BatchQueue(
        backlog_s=backlog_s, queued=queued, seconds_per_input=0.001, batch_rows=32,
        full_batch_s=0.032,
    )  # fmt: skip


def test_inputs_queued_in_the_request_s_own_batch_are_not_ahead_of_it() -> None:
    # A 64-connection loop: 20 ms left of the running batch, 31 queued, this is the 32nd.
    # It runs in the next batch, with them: 20 ms, then that batch (here estimated 30 ms).
    estimate = batch_delay(_queue(0.020 + 0.031, queued=31), rows=1, partial_batch_s=0.030)
    assert estimate.backlog_s == pytest.approx(0.020)
    assert estimate.own_compute_s == pytest.approx(0.030)
    assert delay_verdict(estimate, deadline=10.0, now=0.0, max_queue_delay_s=0.1) is None


def test_behind_a_full_batch_a_request_waits_for_it_and_a_full_batch_of_its_own() -> None:
    # Overload: 70 queued behind 20 ms of running work. Two full batches are ahead of it;
    # its own batch fills behind it before it runs: 20 + 64 + 32 = 116 ms, over the 100 ms
    # budget. Counted input by input (20 + 70 ms, plus the 10 ms of the batch as queued so
    # far) it would have been admitted to wait 116 ms.
    estimate = batch_delay(_queue(0.020 + 0.070, queued=70), rows=1, partial_batch_s=0.010)
    assert estimate.backlog_s == pytest.approx(0.020 + 2 * 0.032)
    assert estimate.own_compute_s == pytest.approx(0.032)
    verdict = delay_verdict(estimate, deadline=10.0, now=0.0, max_queue_delay_s=0.1)
    assert verdict is not None and verdict.reason is RejectReason.QUEUE
    assert verdict.retry_after_s == pytest.approx(0.016)


def test_a_request_of_many_rows_waits_for_the_batches_before_its_last_row() -> None:
    # 10 queued, 60 rows: its last row is row 70, in the third batch (rows 65-96). Alone its
    # rows fill two batches; the inputs queued ahead add the third.
    estimate = batch_delay(_queue(0.010, queued=10), rows=60, partial_batch_s=0.008)
    assert estimate.backlog_s == pytest.approx(0.032)
    assert estimate.own_compute_s == pytest.approx(2 * 0.032)


def test_inputs_ahead_that_push_a_request_into_another_batch_are_waited_for() -> None:
    # 20 queued, nothing running, 20 rows: alone one batch, behind them two.
    estimate = batch_delay(_queue(0.020, queued=20), rows=20, partial_batch_s=0.020)
    assert estimate.backlog_s == pytest.approx(0.032)
    assert estimate.own_compute_s == pytest.approx(0.032)


def test_on_an_idle_engine_a_request_of_more_rows_than_a_batch_is_admitted() -> None:
    """Its own first batch was counted as backlog: with "something ahead" it was refused
    429 for a wait over the budget, and every retry was too."""
    estimate = batch_delay(_queue(0.0, queued=0), rows=64, partial_batch_s=0.032)
    assert estimate.backlog_s == 0.0
    assert estimate.own_compute_s == pytest.approx(2 * 0.032)
    assert delay_verdict(estimate, deadline=10.0, now=0.0, max_queue_delay_s=0.05) is None
    # Behind a full batch of others it waits like anyone: refused, retryable.
    busy = batch_delay(_queue(0.032, queued=32), rows=64, partial_batch_s=0.032)
    assert busy.backlog_s == pytest.approx(0.032)
    refused = delay_verdict(busy, deadline=10.0, now=0.0, max_queue_delay_s=0.05)
    assert refused is not None and refused.reason is RejectReason.QUEUE


def test_without_a_batch_size_the_queue_counts_input_by_input() -> None:
    # What a front end gets from an engine that publishes no full batch (generation only):
    # batches of one row computing in no time, so the prediction is the linear one.
    queue = BatchQueue(
        backlog_s=0.050, queued=5, seconds_per_input=0.010, batch_rows=1, full_batch_s=0.0
    )
    estimate = batch_delay(queue, rows=1, partial_batch_s=0.004)
    assert estimate.backlog_s == pytest.approx(0.050)
    assert estimate.own_compute_s == pytest.approx(0.004)
