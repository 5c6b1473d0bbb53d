"""Which requests are slow, and what is kept of them: a bounded ring of reports (newest
first for GET /debug/slow), one structured log line each (at most `LOG_LINES_PER_S` a
second: past that, the next line counts the reports it did not log), and
`steadyserve_slow_requests_total{cause}` by the top cause.

A request is slow past `slow_request_ms`, or, with `slow_request_p99_multiple` set, past
that multiple of the running p99 of this front end's last requests (never under
`slow_request_ms`). One recorder per front end; its event loop thread only.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec

from app.metrics import Metrics
from app.spikes.attribution import Cause, RequestFacts, attribute

log = logging.getLogger("app.spikes")

P99_WINDOW = 1000
P99_REFRESH_EVERY = 100
# Log lines a second, per front end. Under overload nearly every admitted request is slow:
# a line each (a log record, its JSON, a write) took ~10 % of a flooded front end's time
# (py-spy at 5,000 connections, docs/BENCHMARKS.md), for lines that say the same thing.
LOG_LINES_PER_S = 10


class RunningP99:
    """p99 of the last `window` latencies, recomputed every `refresh_every` additions (a
    sort of 1000 floats, about 100 us, once per hundred requests)."""

    def __init__(self, window: int = P99_WINDOW, refresh_every: int = P99_REFRESH_EVERY) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self._refresh_every = refresh_every
        self._since_refresh = 0
        self.value: float | None = None

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)
        self._since_refresh += 1
        if self._since_refresh >= self._refresh_every:
            self._since_refresh = 0
            ordered = sorted(self._recent)
            self.value = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@dataclass(frozen=True, slots=True)
class SlowReport:
    report_id: int
    at: float  # wall-clock seconds (time.time) when the answer was sent
    method: str
    path: str
    status: int
    total_s: float
    threshold_s: float
    facts: RequestFacts
    causes: list[Cause]

    @property
    def top_cause(self) -> str:
        return self.causes[0].name if self.causes else "unaccounted"

    def as_dict(self) -> dict[str, object]:
        engine = self.facts.engine
        return {
            "id": self.report_id,
            "at": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.at))
            + f".{int(self.at % 1 * 1000):03d}Z",
            "request": {"method": self.method, "path": self.path, "status": self.status},
            "total_ms": round(self.total_s * 1000, 2),
            "threshold_ms": round(self.threshold_s * 1000, 2),
            "top_cause": self.top_cause,
            "causes": [c.as_dict() for c in self.causes],
            "phases_ms": {k: round(v * 1000, 3) for k, v in self.facts.phases.items()},
            "batch": msgspec.to_builtins(engine.batch) if engine and engine.batch else None,
            "queue_depth_at_arrival": engine.queue_depth_at_arrival if engine else None,
            "probes": {
                "frontend": {"pid": self.facts.frontend_pid, **self.facts.frontend_probes},
                "engine": {"pid": engine.pid, **engine.probes} if engine else None,
            },
        }


class SlowRequestRecorder:
    def __init__(
        self,
        metrics: Metrics,
        slow_after_s: float,
        p99_multiple: float | None,
        keep: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._metrics = metrics
        self.slow_after_s = slow_after_s
        self.p99_multiple = p99_multiple
        self._reports: deque[SlowReport] = deque(maxlen=keep)
        self._p99 = RunningP99()
        self._ids = itertools.count(1)
        self._clock = clock
        self._log_second = -1.0  # the whole second the lines counted below were logged in
        self._logged_this_second = 0
        self._unlogged = 0  # reports not logged since the last line

    def threshold_s(self) -> float:
        if self.p99_multiple is None or self._p99.value is None:
            return self.slow_after_s
        return max(self.slow_after_s, self.p99_multiple * self._p99.value)

    def slow_threshold(self, total_s: float) -> float | None:
        """The threshold a finished request of `total_s` is slow against, or None when it is
        not slow. Call once per finished request: it feeds the running p99 (after judging,
        so a report keeps the threshold it was judged by, never one above its total)."""
        threshold = self.threshold_s()
        if self.p99_multiple is not None:
            self._p99.add(total_s)
        return threshold if total_s > threshold else None

    def record(
        self, method: str, path: str, status: int, facts: RequestFacts, threshold_s: float
    ) -> SlowReport:
        """Attribute a slow request, keep its report, count and log it; `threshold_s`: the
        one it was judged slow against (`slow_threshold`)."""
        report = SlowReport(
            report_id=next(self._ids),
            at=self._clock(),
            method=method,
            path=path,
            status=status,
            total_s=facts.total_s,
            threshold_s=threshold_s,
            facts=facts,
            causes=attribute(facts),
        )
        self._reports.append(report)
        self._metrics.slow_requests.labels(report.top_cause).inc()
        self._log(report)
        return report

    def _log(self, report: SlowReport) -> None:
        second = float(int(report.at))
        if second != self._log_second:
            self._log_second, self._logged_this_second = second, 0
        if self._logged_this_second >= LOG_LINES_PER_S:
            self._unlogged += 1
            return
        self._logged_this_second += 1
        fields = _log_fields(report)
        if self._unlogged:
            fields = {**fields, "unlogged_before": self._unlogged}
            self._unlogged = 0
        log.warning("slow request %s", json.dumps(fields, separators=(",", ":")))

    def recent(self, limit: int | None = None) -> list[SlowReport]:
        """Newest first."""
        newest_first = list(reversed(self._reports))
        return newest_first if limit is None else newest_first[:limit]


def _log_fields(report: SlowReport) -> Mapping[str, object]:
    """The log line: enough to grep and chart, the full report at /debug/slow."""
    return {
        "id": report.report_id,
        "path": report.path,
        "status": report.status,
        "total_ms": round(report.total_s * 1000, 1),
        "top_cause": report.top_cause,
        "causes": {c.name: round(c.seconds * 1000, 1) for c in report.causes[:4]},
        "evidence": report.causes[0].evidence if report.causes else "",
    }
