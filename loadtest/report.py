"""Turn a run's records into a summary (`summarize`, with the generator's `self_check`) and an
SLA verdict (`judge`); the table and report.json are `loadtest/report_output.py`, the plots
`loadtest/report_plots.py`.

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

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from loadtest.records import ERROR_KINDS, Mode, RunResult
from loadtest.stats import REPORTED_PERCENTILES, percentile_of_sorted

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
