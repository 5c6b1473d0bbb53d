"""The scheduler's cost per batch against how many inputs are queued: it must stay flat.

Under overload on a GPU a model queues hundreds of inputs up to `max_queue` (4,096): the
delay budget over the compute of one input. What the batch loop asks the scheduler per
batch then runs on the event loop the whole engine shares, so it has to cost O(log n) in
queued inputs, not a scan (`app/bucket_queue.py`). Per batch this times what the loop
does: a wake while every compute slot is busy (`expire`, then `ready_at`), then a `poll`
that takes a full batch. The queue is topped up to n after each batch (not timed), with
random deadlines that leave every input time, all of one length bucket of the four (the
others' cost is there, empty), so every batch is a full one of `--max-batch-size` rows, the
most urgent of n, whatever n.

Prints microseconds per batch at each n and the flatness ratio, cost at the largest n over
cost at the smallest (near 1 when flat; the old scans made it grow with n). Each n runs
`--repeats` times, after a warm-up; the median counts.

``python -m loadtest.scheduler_bench [--sizes 64,512,4096] [--batches 2000] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

from app.scheduler import BatchPolicy, Scheduler, WorkItem

LENGTHS = (16, 32, 64, 128)


class QueueAt:
    """A scheduler kept at `size` queued inputs, on a clock that moves 1 ms a batch."""

    def __init__(self, policy: BatchPolicy, size: int, seed: int) -> None:
        self.scheduler = Scheduler(policy)
        self.rng = random.Random(seed)
        self.ids = itertools.count()
        self.now = 0.0
        self.size = size
        for shape in policy.shapes():  # as warm-up measures them: 0.2 ms + 20 us a row
            self.scheduler.record_compute(shape, 0.0002 + 0.00002 * shape.batch)
        self.top_up()

    def top_up(self) -> None:
        """Arrivals: back to `size` queued, a few requests' inputs at each moment."""
        while self.scheduler.depth < self.size:
            deadline = self.now + 60.0 + self.rng.random()
            item = WorkItem(next(self.ids), LENGTHS[0], LENGTHS[0], self.now, deadline)
            self.scheduler.enqueue(item)

    def batch(self) -> float:
        """One batch's scheduler calls, timed (seconds); then the queue is topped up."""
        scheduler, now = self.scheduler, self.now
        started = time.perf_counter()
        scheduler.expire(now)
        scheduler.ready_at(now)
        decision = scheduler.poll(now)
        elapsed = time.perf_counter() - started
        assert decision.batch is not None, "a full queue always has a batch ready"
        scheduler.finished(decision.batch)
        self.now += 0.001
        self.top_up()
        return elapsed


def cost_per_batch_us(policy: BatchPolicy, size: int, batches: int, seed: int) -> float:
    """Mean microseconds of one batch's scheduler calls at `size` queued inputs."""
    queue = QueueAt(policy, size, seed)
    for _ in range(min(batches, 200)):  # warm-up: caches, the heaps' first rebuilds
        queue.batch()
    return sum(queue.batch() for _ in range(batches)) / batches * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.scheduler_bench")
    parser.add_argument("--sizes", default="64,512,4096", help="Queued inputs, comma-separated.")
    parser.add_argument("--batches", type=int, default=2000, help="Timed batches per run.")
    parser.add_argument("--repeats", type=int, default=5, help="Runs per size (the median counts).")
    parser.add_argument("--max-batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    policy = BatchPolicy(
        length_buckets=LENGTHS,
        max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_size * LENGTHS[-1],
        max_wait_s=0.005,
    )
    print(f"scheduler cost per batch ({args.max_batch_size} rows: expire + ready_at + poll)")
    medians: dict[int, float] = {}
    for size in sizes:
        runs = [cost_per_batch_us(policy, size, args.batches, seed) for seed in range(args.repeats)]
        medians[size] = statistics.median(runs)
        spread = (max(runs) - min(runs)) / medians[size]
        print(f"  n={size:>6}: {medians[size]:8.1f} us/batch  (runs spread {spread:.0%})")
    smallest, largest = min(sizes), max(sizes)
    ratio = medians[largest] / medians[smallest]
    print(f"flatness: cost(n={largest}) / cost(n={smallest}) = {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
