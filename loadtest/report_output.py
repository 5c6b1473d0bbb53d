"""A run's summary as text, for people and for programs: `format_table`, the table printed
after a run, and `write_json`, report.json (the summary, the run's configuration and its
timeline). The figures themselves come from `loadtest/report.py`; the plots are
`loadtest/report_plots.py`. Any thread may call these once the run is over.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.records import RunResult
from loadtest.report import Summary, percentile_label
from loadtest.stats import REPORTED_PERCENTILES


def _milliseconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(summary: Summary) -> str:
    """The human-readable summary printed at the end of a run."""
    rows: list[tuple[str, str]] = []
    if summary.mode == "open":
        load = f"open loop, {summary.arrival} arrivals, stages {summary.stages} (req/s)"
    else:
        load = f"closed loop, stages {summary.stages} (connections)"
    rows.append(("target", f"{summary.url} [{summary.label}]"))
    rows.append(("load", load))
    timing = f"{summary.duration_s:.1f} s scheduled, {summary.elapsed_s:.1f} s to last answer"
    rows.append(("duration", timing))
    rows.append(
        (
            "requests",
            f"{summary.requests} (2xx {summary.ok}, 429 {summary.status_counts.get('429', 0)}"
            f" = {summary.share_429:.2%}, error rate {summary.error_rate:.3%})",
        )
    )
    offered = (
        f"offered {summary.sent_rate_rps:.1f} of {summary.target_rate_rps:.1f} req/s"
        if summary.target_rate_rps is not None
        else f"sent {summary.sent_rate_rps:.1f} req/s"
    )
    rows.append(("throughput", f"{summary.throughput_rps:.1f} req/s 2xx ({offered})"))
    if summary.latency_ms:
        figures = "  ".join(
            f"{name} {summary.latency_ms[name]:.1f}"
            for name in [*(percentile_label(q) for q in REPORTED_PERCENTILES), "max"]
        )
        rows.append(("latency ms", f"{figures}  mean {_milliseconds(summary.latency_mean_ms)}"))
    else:
        rows.append(("latency ms", "no 2xx responses"))
    statuses = "  ".join(f"{code}: {count}" for code, count in summary.status_counts.items())
    rows.append(("status", statuses or "none"))
    errors = "  ".join(f"{kind}: {count}" for kind, count in summary.errors_by_kind.items())
    rows.append(("no response", errors or "none"))
    rows.append(
        (
            "retried",
            f"{summary.retried_requests} requests after 429 ({summary.retry_attempts} retries)",
        )
    )
    lag = (
        f", dispatch lag p99 {summary.dispatch_lag_p99_ms:.2f} ms"
        if summary.dispatch_lag_p99_ms is not None
        else ""
    )
    if summary.generator_cpu_peak > 0 or lag:  # hey runs have no generator figures
        rows.append(
            (
                "generator",
                f"cpu {summary.generator_cpu_mean:.0%} of a core (peak "
                f"{summary.generator_cpu_peak:.0%}){lag}",
            )
        )
    verdict = summary.verdict
    if verdict is not None and (verdict.reasons or verdict.checks):
        if verdict.passed:
            rows.append(("verdict", "PASS: " + "; ".join(verdict.checks)))
        else:
            rows.append(("verdict", "FAIL: " + "; ".join(verdict.reasons)))
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    lines.extend(f"WARNING: {warning}" for warning in summary.warnings)
    return "\n".join(lines)


def report_document(summary: Summary, result: RunResult) -> dict[str, Any]:
    config = result.config
    return {
        "summary": asdict(summary),
        "config": {
            "mode": config.mode.value,
            "arrival": config.arrival.value,
            "stages": [asdict(stage) for stage in config.stages],
            "connections": config.connections,
            "timeout_s": config.timeout_s,
            "retry_429": config.retry_429,
            "max_retries": config.max_retries,
            "seed": config.seed,
        },
        "timeline": [asdict(sample) for sample in result.timeline],
    }


def write_json(summary: Summary, result: RunResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report_document(summary, result), indent=2, allow_nan=False) + "\n")
    return path
