"""Turn a run's records into a summary, a verdict, a table, a JSON file and PNG plots.

Definitions used throughout (also in loadtest/README.md):

- latency: from the request's scheduled send time to its final answer (open loop), or
  from its first send (closed loop); retries after a 429 stay within one request.
- latency percentiles are over requests answered 2xx; failures are judged by the error
  rate instead, so a server cannot improve its p99 by failing fast.
- error rate: requests whose final outcome was not 2xx (HTTP 4xx/5xx including 429, or
  no response at all: connect, closed, timeout, protocol, unfinished) over all requests.
- throughput: 2xx answers per second, from the start to the last answer.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from loadtest.records import ERROR_KINDS, Mode, RunResult
from loadtest.stats import (
    REPORTED_PERCENTILES,
    LogBuckets,
    percentile_of_sorted,
    rolling_percentile,
)

# The generator counts as CPU-bound when it used this share of one core. It is one Python
# thread, and part of its network work is done by the kernel outside its accounting, so a
# saturated generator shows 70-100 % (measured on the 2-core machine, loadtest/README.md).
CPU_BOUND_FRACTION = 0.7
# Sends may slip this far behind the schedule before the self-check calls it lag.
DISPATCH_LAG_TOLERANCE_S = 0.010
# The offered rate counts as reached at this share of the target.
TARGET_REACHED_SHARE = 0.95

FloatArray = npt.NDArray[np.float64]


@dataclass
class Verdict:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)


@dataclass
class Summary:
    label: str
    url: str
    mode: str
    arrival: str
    stages: str
    duration_s: float
    elapsed_s: float
    requests: int
    ok: int
    throughput_rps: float
    target_rate_rps: float | None
    sent_rate_rps: float
    latency_ms: dict[str, float]
    latency_mean_ms: float | None
    status_counts: dict[str, int]
    share_429: float
    errors_by_kind: dict[str, int]
    error_rate: float
    retried_requests: int
    retry_attempts: int
    generator_cpu_mean: float
    generator_cpu_peak: float
    dispatch_lag_p99_ms: float | None
    max_backlog: int
    warnings: list[str]
    verdict: Verdict | None = None


@dataclass
class Arrays:
    """The records as numpy arrays, times relative to the run's start."""

    scheduled: FloatArray
    sent: FloatArray
    done: FloatArray
    latency: FloatArray
    status: npt.NDArray[np.int16]
    error: npt.NDArray[np.int8]

    @classmethod
    def of(cls, result: RunResult) -> Arrays:
        recorder = result.recorder
        start = result.started_at
        scheduled = np.frombuffer(recorder.scheduled, dtype=np.float64) - start
        done = np.frombuffer(recorder.done, dtype=np.float64) - start
        order = np.argsort(scheduled, kind="stable")
        return cls(
            scheduled=scheduled[order],
            sent=(np.frombuffer(recorder.sent, dtype=np.float64) - start)[order],
            done=done[order],
            latency=(done - scheduled)[order],
            status=np.frombuffer(recorder.status, dtype=np.int16)[order],
            error=np.frombuffer(recorder.error, dtype=np.int8)[order],
        )

    @property
    def ok_mask(self) -> npt.NDArray[np.bool_]:
        return (self.status >= 200) & (self.status < 300)


def percentile_label(q: float) -> str:
    return f"p{q:g}"


def latency_percentiles_ms(latencies_s: FloatArray) -> dict[str, float]:
    if latencies_s.size == 0:
        return {}
    ordered: list[float] = np.sort(latencies_s).tolist()
    figures = {
        percentile_label(q): percentile_of_sorted(ordered, q) * 1000.0 for q in REPORTED_PERCENTILES
    }
    figures["max"] = ordered[-1] * 1000.0
    figures["min"] = ordered[0] * 1000.0
    return figures


def summarize(result: RunResult, url: str, label: str = "run") -> Summary:
    config = result.config
    arrays = Arrays.of(result)
    total = int(arrays.status.size)
    ok_mask = arrays.ok_mask
    ok = int(ok_mask.sum())
    last_done = float(arrays.done.max()) if total else 0.0
    elapsed = max(last_done, 1e-9)
    status_counts = Counter(int(code) for code in arrays.status if code != 0)
    errors_by_kind = Counter(ERROR_KINDS[int(code)] for code in arrays.error if code != 0)
    rejected = status_counts.get(429, 0)
    duration = config.duration_s
    sent_in_window = int(np.count_nonzero(arrays.sent <= duration))
    lags = np.frombuffer(result.dispatch_lags, dtype=np.float64)
    cpu = [sample.cpu_fraction for sample in result.timeline]
    target_rate = result.scheduled_total / duration if config.mode is Mode.OPEN else None
    summary = Summary(
        label=label,
        url=url,
        mode=config.mode.value,
        arrival=config.arrival.value if config.mode is Mode.OPEN else "-",
        stages=",".join(
            f"{s.duration_s:g}s:{s.start:g}" + (f"-{s.end:g}" if s.end != s.start else "")
            for s in config.stages
        ),
        duration_s=duration,
        elapsed_s=elapsed,
        requests=total,
        ok=ok,
        throughput_rps=ok / elapsed,
        target_rate_rps=target_rate,
        sent_rate_rps=sent_in_window / duration,
        latency_ms=latency_percentiles_ms(arrays.latency[ok_mask]),
        latency_mean_ms=float(arrays.latency[ok_mask].mean()) * 1000.0 if ok else None,
        status_counts={str(code): count for code, count in sorted(status_counts.items())},
        share_429=rejected / total if total else 0.0,
        errors_by_kind=dict(sorted(errors_by_kind.items())),
        error_rate=(total - ok) / total if total else 0.0,
        retried_requests=result.recorder.retried_requests,
        retry_attempts=result.recorder.retry_attempts,
        generator_cpu_mean=float(np.mean(cpu)) if cpu else 0.0,
        generator_cpu_peak=max(cpu) if cpu else 0.0,
        dispatch_lag_p99_ms=(
            percentile_of_sorted(np.sort(lags).tolist(), 99.0) * 1000.0 if lags.size else None
        ),
        max_backlog=max((sample.backlog for sample in result.timeline), default=0),
        warnings=[],
    )
    summary.warnings = self_check(result, summary)
    return summary


def self_check(result: RunResult, summary: Summary) -> list[str]:
    """Warnings about the generator itself: was it the bottleneck of this run?"""
    warnings: list[str] = []
    # Judge the CPU where the schedule slipped, if it did; over the whole run otherwise.
    lagging_intervals = [
        s.cpu_fraction for s in result.timeline if s.dispatch_lag_max_s > DISPATCH_LAG_TOLERANCE_S
    ]
    judged = lagging_intervals or [s.cpu_fraction for s in result.timeline]
    cpu_bound = bool(judged) and sum(judged) / len(judged) >= CPU_BOUND_FRACTION
    cpu_text = (
        f"it used {summary.generator_cpu_mean:.0%} of a core on average, "
        f"{summary.generator_cpu_peak:.0%} at peak"
    )
    if result.config.mode is Mode.OPEN:
        assert summary.target_rate_rps is not None
        reached = summary.sent_rate_rps >= TARGET_REACHED_SHARE * summary.target_rate_rps
        lagging = (summary.dispatch_lag_p99_ms or 0.0) > DISPATCH_LAG_TOLERANCE_S * 1000.0
        if cpu_bound and (not reached or lagging):
            warnings.append(
                "GENERATOR BOTTLENECK: the target rate "
                f"({summary.target_rate_rps:.0f} req/s) was not offered on time "
                f"(sent {summary.sent_rate_rps:.0f} req/s, dispatch lag p99 "
                f"{summary.dispatch_lag_p99_ms or 0.0:.1f} ms) while the generator was "
                f"CPU-bound ({cpu_text}); these figures describe the generator, not the "
                "server. Lower the rate or split it over several generator processes."
            )
        elif lagging:
            warnings.append(
                f"the generator's event loop fell behind its schedule (dispatch lag p99 "
                f"{summary.dispatch_lag_p99_ms or 0.0:.1f} ms) without being CPU-bound "
                f"({cpu_text}): another process is probably starving it of CPU."
            )
        if not reached and not cpu_bound and summary.max_backlog > 0:
            warnings.append(
                f"all {result.config.connections} connections were busy at times (up to "
                f"{summary.max_backlog} requests waited in the client, their wait counted "
                "in their latency): the server could not keep up, or --connections is too low."
            )
    elif cpu_bound:
        warnings.append(
            f"GENERATOR BOTTLENECK: the generator was CPU-bound ({cpu_text}); closed-loop "
            "throughput may be limited by the generator rather than the server."
        )
    return warnings


def judge(summary: Summary, slo_p99_ms: float | None, max_error_rate: float | None) -> Verdict:
    """The SLA verdict: passed unless a given limit is exceeded; each failure has a reason."""
    verdict = Verdict(passed=True)
    if slo_p99_ms is not None:
        p99 = summary.latency_ms.get("p99")
        if p99 is None:
            verdict.reasons.append("no 2xx response, so no p99 to hold to the SLO")
        elif p99 > slo_p99_ms:
            verdict.reasons.append(f"p99 latency {p99:.1f} ms exceeds the SLO of {slo_p99_ms:g} ms")
        else:
            verdict.checks.append(f"p99 {p99:.1f} ms <= {slo_p99_ms:g} ms")
    if max_error_rate is not None:
        if summary.requests == 0:
            verdict.reasons.append("no request completed")
        elif summary.error_rate > max_error_rate:
            verdict.reasons.append(
                f"error rate {summary.error_rate:.3%} exceeds the maximum of {max_error_rate:.3%}"
                f" ({summary.requests - summary.ok} of {summary.requests} requests not 2xx)"
            )
        else:
            verdict.checks.append(f"error rate {summary.error_rate:.3%} <= {max_error_rate:.3%}")
    verdict.passed = not verdict.reasons
    return verdict


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


# -- plots --------------------------------------------------------------------------------


PLOTS_MISSING_NOTE = (
    "plots skipped: matplotlib is not installed (pip install 'steadyserve[plots]'); "
    "the table and report.json are written"
)


def _rolling_window_s(duration_s: float) -> float:
    # About a hundred windows over the run, but never under a second (too few samples).
    return max(1.0, duration_s / 100.0)


def write_plots(
    summary: Summary,
    result: RunResult,
    out_dir: Path,
    slo_p99_ms: float | None = None,
    max_points: int = 200_000,
) -> list[Path]:
    """Three PNGs: latency over time, latency histogram, throughput and errors over time.

    Plots are an optional extra: without matplotlib this writes nothing, says on stderr how
    to get them, and returns no paths (the table and report.json do not depend on it).
    """
    try:
        import matplotlib
    except ImportError:
        sys.stderr.write(PLOTS_MISSING_NOTE + "\n")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    arrays = Arrays.of(result)
    ok_mask = arrays.ok_mask
    title = f"{summary.label}: {summary.mode} loop, {summary.stages}"
    paths: list[Path] = []

    # 1. Every request as a point, its rolling p99 and the SLO.
    figure, axes = plt.subplots(figsize=(11, 5))
    latency_ms = arrays.latency * 1000.0
    shown = np.arange(arrays.latency.size)
    if shown.size > max_points:  # keep the file small; the p99 line still uses every request
        shown = np.sort(np.random.default_rng(0).choice(shown, max_points, replace=False))
    shown_ok = shown[ok_mask[shown]]
    shown_failed = shown[~ok_mask[shown]]
    axes.scatter(
        arrays.scheduled[shown_ok], latency_ms[shown_ok], s=2, alpha=0.35, label="2xx request"
    )
    if shown_failed.size:
        axes.scatter(
            arrays.scheduled[shown_failed],
            np.maximum(latency_ms[shown_failed], 1e-3),
            s=6,
            marker="x",
            color="tab:red",
            alpha=0.6,
            label="not 2xx",
        )
    window = _rolling_window_s(summary.duration_s)
    times, p99s = rolling_percentile(
        arrays.scheduled[ok_mask].tolist(), latency_ms[ok_mask].tolist(), window, window / 4, 99.0
    )
    if times:
        axes.plot(times, p99s, color="black", linewidth=1.5, label=f"rolling p99 ({window:g} s)")
    if slo_p99_ms is not None:
        axes.axhline(slo_p99_ms, color="tab:red", linestyle="--", label=f"SLO {slo_p99_ms:g} ms")
    axes.set_yscale("log")
    axes.set_xlabel("scheduled send time (s from start)")
    axes.set_ylabel("latency (ms, log)")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="upper left", markerscale=3)
    paths.append(out_dir / "latency_over_time.png")
    figure.tight_layout()
    figure.savefig(paths[-1], dpi=110)
    plt.close(figure)

    # 2. Histogram of 2xx latencies on geometric bins (equal width on the log axis).
    figure, axes = plt.subplots(figsize=(9, 5))
    ok_latency_ms = latency_ms[ok_mask]
    if ok_latency_ms.size:
        edges = np.array(LogBuckets(lowest=1e-2, highest=1e6, per_decade=20).edges())
        low, high = float(ok_latency_ms.min()), float(ok_latency_ms.max())
        first = max(int(np.searchsorted(edges, low, side="right")) - 1, 0)
        last = min(int(np.searchsorted(edges, high, side="left")) + 1, edges.size)
        edges = edges[first:last] if last - first >= 2 else np.array([low * 0.9, high * 1.1])
        axes.hist(ok_latency_ms, bins=edges.tolist())
        for name, style in (("p50", ":"), ("p99", "--")):
            value = summary.latency_ms.get(name)
            if value is not None:
                axes.axvline(value, color="black", linestyle=style, label=f"{name} {value:.1f} ms")
    if slo_p99_ms is not None:
        axes.axvline(slo_p99_ms, color="tab:red", linestyle="--", label=f"SLO {slo_p99_ms:g} ms")
    axes.set_xscale("log")
    axes.set_xlabel("latency (ms, log)")
    axes.set_ylabel("requests")
    axes.set_title(f"{title}: latency of 2xx responses")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    paths.append(out_dir / "latency_histogram.png")
    figure.tight_layout()
    figure.savefig(paths[-1], dpi=110)
    plt.close(figure)

    # 3. Answers per second by outcome (binned by answer time), and the generator's CPU.
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    end = max(float(arrays.done.max()) if arrays.done.size else 0.0, summary.duration_s)
    bins = np.arange(0.0, math.ceil(end) + 1.0, 1.0)
    rejected_mask = arrays.status == 429
    other_mask = ~ok_mask & ~rejected_mask
    for mask, name, color in (
        (ok_mask, "2xx/s", "tab:green"),
        (rejected_mask, "429/s", "tab:orange"),
        (other_mask, "other errors/s", "tab:red"),
    ):
        counts, _ = np.histogram(arrays.done[mask], bins=bins)
        if name == "2xx/s" or counts.any():
            top.step(bins[:-1], counts, where="post", label=name, color=color)
    if summary.mode == "open":
        due, _ = np.histogram(arrays.scheduled, bins=bins)
        top.step(bins[:-1], due, where="post", label="scheduled/s", color="gray", linestyle="--")
    top.set_ylabel("per second")
    top.set_title(f"{title}: throughput and errors")
    top.grid(True, alpha=0.3)
    top.legend(loc="upper left")
    bottom.plot(
        [s.elapsed_s for s in result.timeline],
        [s.cpu_fraction * 100.0 for s in result.timeline],
        color="tab:purple",
    )
    bottom.axhline(CPU_BOUND_FRACTION * 100.0, color="tab:red", linestyle=":", linewidth=1)
    bottom.set_ylabel("generator\nCPU % of a core")
    bottom.set_xlabel("time (s from start)")
    bottom.grid(True, alpha=0.3)
    paths.append(out_dir / "throughput_errors.png")
    figure.tight_layout()
    figure.savefig(paths[-1], dpi=110)
    plt.close(figure)
    return paths
