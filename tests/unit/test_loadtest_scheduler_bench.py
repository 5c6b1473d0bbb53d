"""loadtest/scheduler_bench.py measures what it says: each timed batch is a full one taken
from a queue kept at its size, and it prints a cost per size and the flatness ratio (a few
batches here: a smoke test, not a measurement)."""

from __future__ import annotations

import pytest

from app.scheduler import BatchPolicy
from loadtest.scheduler_bench import LENGTHS, QueueAt, main

POLICY = BatchPolicy(
    length_buckets=LENGTHS, max_batch_size=8, max_batch_tokens=1024, max_wait_s=0.005
)


def test_every_timed_batch_is_full_and_the_queue_stays_at_its_size() -> None:
    queue = QueueAt(POLICY, 100, seed=0)
    for _ in range(30):
        depth = queue.scheduler.depth
        assert queue.batch() > 0
        assert depth == queue.scheduler.depth == 100
    assert queue.scheduler.backlog_seconds(queue.now) > 0


def test_it_prints_the_cost_per_size_and_the_flatness(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes", "40,80", "--batches", "5", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "n=    40:" in out and "n=    80:" in out
    assert "flatness: cost(n=80) / cost(n=40) = " in out
