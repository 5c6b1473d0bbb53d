"""The slow-request recorder with injected values: thresholds (fixed, and a multiple of
the running p99 with the fixed one as floor), the threshold a report keeps, the ring
buffer, the counter and the log line (capped per second, the next line counting the
rest), and the `steadyserve spikes` table."""

from __future__ import annotations

import logging

import pytest

from app.metrics import Metrics
from app.spikes.recorder import LOG_LINES_PER_S, RunningP99, SlowRequestRecorder
from app.spikes.table import render_table
from tests.support.request_facts import facts


def test_running_p99_is_recomputed_every_refresh_from_the_window() -> None:
    p99 = RunningP99(window=100, refresh_every=100)
    for index in range(99):
        p99.add(0.01 if index else 1.0)
    assert p99.value is None  # not yet refreshed
    p99.add(0.01)
    assert p99.value == 1.0  # index 99 of 100 sorted: the one slow latency
    for _ in range(100):  # the slow one leaves the window
        p99.add(0.01)
    assert p99.value == 0.01


def test_fixed_threshold_and_ring_buffer(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    recorder = SlowRequestRecorder(metrics, slow_after_s=0.15, p99_multiple=None, keep=2)
    assert recorder.slow_threshold(0.15) is None
    assert recorder.slow_threshold(0.151) == 0.15
    with caplog.at_level(logging.WARNING, logger="app.spikes"):
        for depth in (1, 2, 3):
            recorder.record("POST", "/infer", 200, facts(phases={"queue": 0.3}, depth=depth), 0.15)
    recent = recorder.recent()
    assert [r.facts.engine.queue_depth_at_arrival for r in recent if r.facts.engine] == [3, 2]
    assert (
        metrics.registry.get_sample_value("steadyserve_slow_requests_total", {"cause": "queueing"})
        == 3
    )
    line = caplog.records[-1].getMessage()
    assert line.startswith("slow request {") and '"top_cause":"queueing"' in line


def test_p99_multiple_threshold_has_the_fixed_floor() -> None:
    recorder = SlowRequestRecorder(Metrics(), slow_after_s=0.05, p99_multiple=3.0, keep=10)
    for _ in range(100):
        recorder.slow_threshold(0.001)  # an idle server: p99 1 ms, floor 50 ms
    assert recorder.threshold_s() == 0.05
    for _ in range(1000):
        recorder.slow_threshold(0.1)
    assert recorder.threshold_s() == pytest.approx(0.3)
    assert recorder.slow_threshold(0.29) is None
    assert recorder.slow_threshold(0.31) == pytest.approx(0.3)


def test_spikes_table_renders_reports() -> None:
    recorder = SlowRequestRecorder(Metrics(), slow_after_s=0.1, p99_multiple=None, keep=5)
    report = recorder.record("POST", "/infer", 200, facts(phases={"queue": 0.3}, depth=900), 0.1)
    table = render_table({"frontend_pid": 7, "threshold_ms": 100.0,
                          "reports": [report.as_dict()]})  # fmt: skip
    lines = table.splitlines()
    assert lines[0] == "front end pid 7, slow past 100.0 ms: 1 report(s), newest first"
    assert "POST /infer" in lines[2] and "queueing 298" in lines[2]
    assert lines[2].endswith("queued 298 ms behind 900 inputs of its model")
    assert render_table({"reports": []}).endswith("(no slow requests)")


def test_log_lines_are_capped_per_second_and_the_next_line_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    metrics = Metrics()
    recorder = SlowRequestRecorder(
        metrics, slow_after_s=0.1, p99_multiple=None, keep=100, clock=lambda: now[0]
    )
    with caplog.at_level(logging.WARNING, logger="app.spikes"):
        for _ in range(LOG_LINES_PER_S + 15):  # a flood's worth within one second
            recorder.record("POST", "/infer", 200, facts(phases={"queue": 0.3}, depth=1), 0.1)
            now[0] += 0.5 / (LOG_LINES_PER_S + 15)
        assert len(caplog.records) == LOG_LINES_PER_S
        now[0] = 101.2
        recorder.record("POST", "/infer", 200, facts(phases={"queue": 0.3}, depth=1), 0.1)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == LOG_LINES_PER_S + 1
    assert '"unlogged_before":15' in lines[-1]
    assert not any("unlogged_before" in line for line in lines[:-1])
    # Every report is still kept and counted.
    assert len(recorder.recent()) == LOG_LINES_PER_S + 16
    assert (
        metrics.registry.get_sample_value("steadyserve_slow_requests_total", {"cause": "queueing"})
        == LOG_LINES_PER_S + 16
    )


def test_a_report_keeps_the_threshold_it_was_judged_slow_against() -> None:
    """Judging feeds the running p99, which may refresh with the slow request in it: the
    report then showed a threshold (600 ms) above its own total (200 ms)."""
    recorder = SlowRequestRecorder(Metrics(), slow_after_s=0.05, p99_multiple=3.0, keep=10)
    for _ in range(99):
        recorder.slow_threshold(0.010)
    threshold_s = recorder.slow_threshold(0.2)
    assert threshold_s == pytest.approx(0.05)
    report = recorder.record("POST", "/infer", 200, facts(total_s=0.2), threshold_s)
    assert report.threshold_s == pytest.approx(0.05)
    assert report.threshold_s <= report.total_s
