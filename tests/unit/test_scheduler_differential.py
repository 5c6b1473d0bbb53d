"""The scheduler on heaps decides exactly as the scheduler it replaced: both driven through
the same seeded random sequences of enqueue, cancel, withdraw, poll, expire, ready_at,
record_compute, runs_until and finished on an injected clock, with equal Decisions (batch,
its shape, reason and items in order, expired and cancelled in order, wake time), depth,
per-bucket counts, backlog and ready_at after every step. The old scheduler is the frozen
oracle in tests/support/scheduler_oracle.py.

The clock moves by whole steps of 0.5 ms or not at all, and deadlines fall on a 1 ms grid,
so equal arrival times, equal deadlines and deadlines met to the tick (the FIFO and
stability rules) come up all the time; requests of up to 70 inputs share a deadline and
an arrival time, as a request's do."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from app.scheduler import Batch, BatchPolicy, Scheduler, WorkItem
from tests.support.scheduler_oracle import OracleScheduler

SEQUENCES = 2000
TICK = 0.0005


@dataclass
class Run:
    """One random sequence: both schedulers, the clock, and what was handed out."""

    rng: random.Random
    policy: BatchPolicy
    new: Scheduler
    old: OracleScheduler
    now: float = 0.0
    next_id: int = 0
    ids: list[int] = field(default_factory=list)  # every id enqueued so far
    running: list[Batch] = field(default_factory=list)
    load: int = 1  # how much more often than usual inputs arrive (3: overload)
    batches: int = 0
    dropped: int = 0
    deepest: int = 0

    def check(self, step: str) -> None:
        new, old = self.new, self.old
        assert new.depth == old.depth, step
        self.deepest = max(self.deepest, new.depth)
        for length in self.policy.length_buckets:
            assert new.queued(length) == old.queued(length), step
        assert new.backlog_seconds(self.now) == old.backlog_seconds(self.now), step
        assert new.ready_at(self.now) == old.ready_at(self.now), step


def random_policy(rng: random.Random) -> BatchPolicy:
    lengths = sorted(rng.sample([8, 16, 32, 64, 128], rng.randint(1, 4)))
    return BatchPolicy(
        length_buckets=tuple(lengths),
        max_batch_size=rng.choice([1, 2, 3, 4, 8, 16, 64]),
        max_batch_tokens=rng.choice([64, 256, 1024, 8192]),
        max_wait_s=rng.choice([0.0, 0.001, 0.005, 0.02]),
    )


def enqueue_request(run: Run) -> None:
    rng, policy = run.rng, run.policy
    inputs = rng.choice([1, 1, 2, 3, 8, rng.randint(1, 70)])
    shared = rng.random() < 0.7  # a request's inputs share its deadline
    deadline = run.now + rng.randint(-2, 80) * 0.001
    for _ in range(inputs):
        n_tokens = rng.randint(1, policy.length_buckets[-1])
        bucket = policy.length_bucket_for(n_tokens)
        assert bucket is not None
        if not shared:
            deadline = run.now + rng.randint(-2, 80) * 0.001
        item = WorkItem(run.next_id, n_tokens, bucket, enqueued_at=run.now, deadline=deadline)
        run.next_id += 1
        run.ids.append(item.item_id)
        run.new.enqueue(item)
        run.old.enqueue(item)


def some_ids(run: Run) -> list[int]:
    """Queued, batched, dropped and unknown ids alike, some of a recent request."""
    rng = run.rng
    if not run.ids:
        return [rng.randint(0, 5)]
    recent = run.ids[-rng.randint(1, min(len(run.ids), 80)) :]
    picked = rng.sample(recent, rng.randint(1, min(len(recent), 12)))
    if rng.random() < 0.2:
        picked.append(run.next_id + rng.randint(0, 3))  # not enqueued (yet)
    return picked


def record_compute(run: Run) -> None:
    shape = run.rng.choice(run.policy.shapes())
    seconds = run.rng.choice([0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.03])
    seconds *= shape.batch ** run.rng.choice([0.0, 0.5, 1.0])
    run.new.record_compute(shape, seconds)
    run.old.record_compute(shape, seconds)


def step(run: Run) -> str:
    """One random operation on both schedulers, its results compared; returns its name."""
    rng = run.rng
    op = rng.choices(
        ["tick", "enqueue", "cancel", "withdraw", "poll", "expire", "compute", "end"],
        weights=[6, 6 * run.load, 2, 1, 5, 3, 1, 2],
    )[0]
    if op == "tick":
        run.now += TICK * rng.choice([0, 1, 1, 2, 4, 10, 40])
    elif op == "enqueue":
        enqueue_request(run)
    elif op == "cancel":
        for item_id in some_ids(run):
            run.new.cancel(item_id)
            run.old.cancel(item_id)
    elif op == "withdraw":
        ids = some_ids(run) if rng.random() < 0.9 else []
        assert run.new.withdraw(ids) == run.old.withdraw(ids)
    elif op in ("poll", "expire"):
        new = getattr(run.new, op)(run.now)
        assert new == getattr(run.old, op)(run.now), op
        run.dropped += len(new.expired) + len(new.cancelled)
        if new.batch is not None:
            run.running.append(new.batch)
            run.batches += 1
    elif op == "compute":
        record_compute(run)
    elif run.running:
        batch = run.running.pop(rng.randrange(len(run.running)))
        if rng.random() < 0.3:  # still running, to end later than estimated
            until = run.now + rng.choice([0.001, 0.01])
            run.new.runs_until(batch, until)
            run.old.runs_until(batch, until)
            run.running.append(batch)
        else:
            run.new.finished(batch)
            run.old.finished(batch)
    return op


def run_sequence(seed: int) -> Run:
    rng = random.Random(seed)
    policy = random_policy(rng)
    run = Run(rng, policy, Scheduler(policy), OracleScheduler(policy))
    run.load = rng.choice([1, 1, 1, 4])
    for _ in range(rng.randint(0, 6)):
        record_compute(run)
    for _ in range(rng.choice([30, 100, 300])):
        run.check(step(run))
    # Drain: the queue empties as the old one did.
    while run.new.depth:
        run.now += TICK * 10
        assert run.new.poll(run.now) == run.old.poll(run.now)
        run.check("drain")
    return run


@pytest.mark.parametrize("block", range(10))
def test_the_heap_scheduler_decides_as_the_old_one_on_random_sequences(block: int) -> None:
    runs = [run_sequence(seed) for seed in range(block, SEQUENCES, 10)]
    # The sequences did reach what they are for: batches, drops, deep queues.
    assert sum(run.batches for run in runs) > 10 * len(runs)
    assert sum(run.dropped for run in runs) > len(runs)
    assert max(run.deepest for run in runs) > 300
