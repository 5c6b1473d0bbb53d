"""The engine's pure parts: backlog prediction, run-time health, restart backoff, and the
protocol's encoding."""

from __future__ import annotations

import pytest

from app.engine.health import BatchHealth
from app.engine.protocol import (
    EmbedOutput,
    EmbedPayload,
    Failure,
    FailureKind,
    FinishReason,
    Output,
    Submit,
    TokensOutput,
    decode_batch_from_engine,
    decode_from_engine,
    decode_to_engine,
    encode,
    encode_batch,
)
from app.engine.supervisor import next_backoff
from app.scheduler import BatchPolicy, BatchShape, Scheduler, WorkItem

POLICY = BatchPolicy(length_buckets=(16, 64), max_batch_size=8, max_batch_tokens=256, max_wait_s=0)


def _queue(scheduler: Scheduler, bucket: int, count: int) -> None:
    for _ in range(count):
        item_id = scheduler.depth + 1000 * bucket
        scheduler.enqueue(WorkItem(item_id, bucket, bucket, enqueued_at=0.0, deadline=10.0))


def test_backlog_is_queued_inputs_at_the_measured_full_batch_cost_per_bucket() -> None:
    scheduler = Scheduler(POLICY)
    # Full batches: 8 rows of 16 tokens take 40 ms; 4 rows of 64 (256 tokens) take 80 ms.
    scheduler.record_compute(BatchShape(8, 16), 0.040)
    scheduler.record_compute(BatchShape(4, 64), 0.080)
    assert scheduler.backlog_seconds(now=0.0) == 0.0
    _queue(scheduler, 16, 12)
    _queue(scheduler, 64, 2)
    assert scheduler.seconds_per_input(16) == pytest.approx(0.005)
    assert scheduler.seconds_per_input(64) == pytest.approx(0.020)
    assert scheduler.backlog_seconds(now=0.0) == pytest.approx(12 * 0.005 + 2 * 0.020)


def test_backlog_counts_what_is_left_of_running_batches_until_they_finish() -> None:
    """A request admitted behind a running batch waits for what is left of it: counting
    only the queue let admitted requests wait up to a batch longer than the budget."""
    scheduler = Scheduler(POLICY)
    scheduler.record_compute(BatchShape(8, 16), 0.040)
    scheduler.record_compute(BatchShape(4, 16), 0.030)
    _queue(scheduler, 16, 12)
    first = scheduler.poll(now=1.000).batch  # 8 rows, estimated 40 ms
    assert first is not None and first.shape == BatchShape(8, 16)
    second = scheduler.poll(now=1.010).batch  # the 4 left, estimated 30 ms
    assert second is not None and second.shape == BatchShape(4, 16)
    # At 1.020: 20 ms left of the first, 20 ms of the second; nothing queued.
    assert scheduler.backlog_seconds(now=1.020) == pytest.approx(0.040)
    _queue(scheduler, 16, 2)
    assert scheduler.backlog_seconds(now=1.020) == pytest.approx(0.040 + 2 * 0.005)
    # Past its estimate, a batch still running adds nothing (it is not negative work).
    assert scheduler.backlog_seconds(now=1.045) == pytest.approx(0.0 + 0.000 + 2 * 0.005)
    scheduler.finished(first)
    assert scheduler.backlog_seconds(now=1.030) == pytest.approx(0.010 + 2 * 0.005)
    scheduler.finished(second)
    assert scheduler.backlog_seconds(now=1.030) == pytest.approx(2 * 0.005)


def test_health_turns_bad_after_consecutive_failures_and_one_success_clears_it() -> None:
    health = BatchHealth(threshold=3)
    for _ in range(2):
        health.record(RuntimeError("device lost"))
    health.record(None)
    health.record(RuntimeError("device lost"))
    health.record(RuntimeError("device lost"))
    assert health.healthy  # the success in between reset the count
    health.record(RuntimeError("device lost"))
    assert not health.healthy
    assert health.problem == "3 consecutive batches failed (RuntimeError)"
    health.record(None)
    assert health.healthy and health.problem is None


def test_one_models_failures_are_not_hidden_by_another_models_successes() -> None:
    """The count was the engine's: model b's batches (a generate model's steps, every few
    ms) reset it between a's failures, so a answered 500 for ever behind a 200 /healthz."""
    health = BatchHealth(threshold=3)
    failing, serving = health.recorder("a"), health.recorder("b")
    for _ in range(2):
        failing(RuntimeError("a's forward"))
        serving(None)
    assert health.healthy
    failing(RuntimeError("a's forward"))
    serving(None)
    assert not health.healthy and not health.lost_device
    assert health.problem == "model 'a': 3 consecutive batches failed (RuntimeError)"
    serving(ValueError("b's turn"))  # b's own count starts at 1; a's problem alone is said
    assert health.problem == "model 'a': 3 consecutive batches failed (RuntimeError)"
    failing(None)  # a success of a's clears a's count only
    assert health.healthy and health.problem is None
    assert health.consecutive_failures == 1  # b's
    for _ in range(2):
        serving(ValueError("b's turn"))
    for _ in range(3):
        failing(RuntimeError("a's forward"))
    assert health.problem == (
        "model 'a': 3 consecutive batches failed (RuntimeError); "
        "model 'b': 3 consecutive batches failed (ValueError)"
    )


def test_restart_backoff_doubles_up_to_its_cap() -> None:
    waits = []
    previous = None
    for _ in range(7):
        previous = next_backoff(previous, first_s=1.0, longest_s=30.0)
        waits.append(previous)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_protocol_messages_round_trip() -> None:
    submit = Submit(7, "m", 123.5, EmbedPayload([[101, 7592, 102], [101, 102]]))
    assert decode_to_engine(encode(submit)) == submit
    output = Output(7, True, EmbedOutput(b"\x00" * 8, 1, 2, 5), queue_s=0.01, compute_s=0.02)
    assert decode_from_engine(encode(output)) == output
    failure = Failure(7, FailureKind.REJECTED, "busy", "queue", 0.25)
    assert decode_from_engine(encode(failure)) == failure
    tokens = Output(8, False, TokensOutput([5], 3), queue_s=0.0, compute_s=0.01)
    final = Output(9, True, TokensOutput([], 4, FinishReason.EOS), queue_s=0.0, compute_s=0.02)
    batch = [tokens, final, failure]
    assert decode_batch_from_engine(encode_batch(batch)) == batch


def test_a_sticky_cuda_error_loses_health_at_once_and_for_good() -> None:
    """A device-side assert leaves the process's CUDA context unusable: the engine ran on
    with it, every batch failing 500, for 5 batches before /healthz said so (the H200 run
    of the tensor tests); and a lucky batch would have reset the count."""
    import torch  # torch's own exception class, as CUDA raises it (built here on the CPU)

    health = BatchHealth(threshold=5)
    lost: list[bool] = []
    health.on_device_lost = lambda: lost.append(True)
    health.record(
        torch.AcceleratorError(
            "CUDA error: device-side assert triggered\n"
            "Search for `cudaErrorAssert' in https://docs.nvidia.com/cuda/ for more information."
        )
    )
    assert not health.healthy and lost == [True]
    assert health.problem == "the device's CUDA context is unusable (a sticky CUDA error)"
    health.record(None)
    health.record(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not health.healthy and lost == [True]  # told once


@pytest.mark.parametrize(
    ("error", "lost"),
    [
        (RuntimeError("CUDA error: unspecified launch failure"), True),  # torch before 2.8
        (RuntimeError("HIP error: an illegal memory access was encountered"), True),
        # cudaErrorContained (226): a hardware error or a bad peer access over NVLink,
        # contained by the GPU; "the process must be terminated and relaunched".
        (
            RuntimeError(
                "CUDA error: Invalid access of peer GPU memory over nvlink or a hardware error"
            ),
            True,
        ),
        (RuntimeError("the device fell over"), False),
        (RuntimeError("CUDA error: out of memory"), False),  # not sticky
        # A model's own exception whose text says so is not the runtime's.
        (ValueError("CUDA error: device-side assert triggered"), False),
    ],
)
def test_only_the_runtime_s_sticky_errors_lose_the_device(error: Exception, lost: bool) -> None:
    health = BatchHealth(threshold=5)
    health.record(error)
    assert health.healthy is not lost
    # Raised from, or while handling, one (a loader's ValueError naming the model).
    try:
        try:
            raise error
        except Exception as inner:
            raise ValueError("mlp: could not be loaded") from inner
    except ValueError as wrapped:
        health = BatchHealth(threshold=5)
        health.record(wrapped)
        assert health.healthy is not lost
