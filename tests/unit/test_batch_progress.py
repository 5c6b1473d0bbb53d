"""What the batch command shows: bar, periodic lines, summary."""

from __future__ import annotations

import io

from app.batchclient.progress import JobProgress, ProgressDisplay, progress_bar, summary
from app.batchclient.stats import BatchStats


def _stats(**changes: object) -> BatchStats:
    values: dict[str, object] = {
        "requests": 60,
        "statuses": {200: 50, 429: 10},
        "resets": 0,
        "timeouts": 0,
        "retries": 10,
        "lines_ok": 50,
        "lines_failed": 0,
        "lines_unfinished": 0,
        "in_flight": 4,
        "concurrency": 12,
        "lowest_concurrency": 4,
        "highest_concurrency": 16,
        "concurrency_cuts": 2,
        "latency_p50_s": 0.01,
        "latency_p99_s": 0.1,
    }
    values.update(changes)
    return BatchStats(**values)  # type: ignore[arg-type]


def test_bar_shows_done_rate_eta_throttling_retries_and_concurrency() -> None:
    progress = JobProgress(200, already_done=50, invalid=0, elapsed_s=10.0, stats=_stats())
    bar = progress_bar(progress, width=10)
    assert bar.startswith("[#####-----] 100/200")
    assert "5 lines/s" in bar and "ETA 0m20s" in bar
    assert "429s 10" in bar and "retries 10" in bar and "concurrency 12" in bar


def test_lines_mode_writes_only_when_due() -> None:
    now = [0.0]
    stream = io.StringIO()
    display = ProgressDisplay(stream, "lines", interval_s=10.0, clock=lambda: now[0])
    progress = JobProgress(100, 0, 0, 1.0, _stats())
    display.tick(progress)
    assert stream.getvalue() == ""
    now[0] = 10.0
    display.tick(progress)
    assert stream.getvalue().count("\n") == 1


def test_summary_counts_invalid_lines_as_failed_and_marks_a_stopped_run() -> None:
    progress = JobProgress(100, 45, invalid=2, elapsed_s=5.0, stats=_stats(lines_failed=3))
    document = summary(progress, stopped_by="SIGTERM")
    assert document["lines_failed"] == 5
    assert document["lines_unfinished"] == 0
    assert document["throttled_429"] == 10
    assert document["latency_p99_ms"] == 100.0
    assert document["complete"] is False
    assert summary(progress, None)["complete"] is True
    unread = JobProgress(200, 45, invalid=2, elapsed_s=5.0, stats=_stats(lines_failed=3))
    assert summary(unread, None)["lines_unfinished"] == 100
    assert summary(unread, None)["complete"] is False
