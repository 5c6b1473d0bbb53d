"""What a batch run has done so far: the running counters and their frozen snapshot."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass

from app.batchclient.pacing import PacingSnapshot
from loadtest.stats import LogHistogram


@dataclass(frozen=True, slots=True)
class BatchStats:
    """Counts so far. Requests count every attempt; lines count items: ``lines_ok`` and
    ``lines_failed`` those whose result ``infer_many`` has yielded, no other."""

    requests: int
    statuses: Mapping[int, int]
    resets: int
    timeouts: int
    retries: int
    lines_ok: int
    lines_failed: int
    lines_unfinished: int
    in_flight: int
    concurrency: int
    lowest_concurrency: int
    highest_concurrency: int
    concurrency_cuts: int
    latency_p50_s: float | None
    latency_p99_s: float | None

    @property
    def throttled(self) -> int:
        return self.statuses.get(429, 0)

    @property
    def successes(self) -> int:
        return sum(n for status, n in self.statuses.items() if 200 <= status < 300)


class Counters:
    """The running counts behind ``BatchStats``; the client's event loop thread only."""

    def __init__(self) -> None:
        self.requests = 0
        self.statuses: collections.Counter[int] = collections.Counter()
        self.resets = 0
        self.timeouts = 0
        self.retries = 0
        self.lines_ok = 0
        self.lines_failed = 0
        self.lines_unfinished = 0
        self.latency = LogHistogram()  # 2xx attempts, seconds; bounded memory

    def snapshot(self, pacing: PacingSnapshot, in_flight: int) -> BatchStats:
        """The counts now, with the concurrency controller's state and what is in flight."""
        latency = self.latency
        return BatchStats(
            requests=self.requests,
            statuses=dict(self.statuses),
            resets=self.resets,
            timeouts=self.timeouts,
            retries=self.retries,
            lines_ok=self.lines_ok,
            lines_failed=self.lines_failed,
            lines_unfinished=self.lines_unfinished,
            in_flight=in_flight,
            concurrency=pacing.limit,
            lowest_concurrency=pacing.lowest_limit,
            highest_concurrency=pacing.highest_limit,
            concurrency_cuts=pacing.decreases,
            latency_p50_s=latency.quantile(50.0) if latency.total else None,
            latency_p99_s=latency.quantile(99.0) if latency.total else None,
        )
