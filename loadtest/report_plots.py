"""A run's plots (`write_plots`): three PNGs, latency over time, the latency histogram, and
throughput and errors over time. An optional extra: without matplotlib it writes nothing and
says so (`PLOTS_MISSING_NOTE`). The figures come from `loadtest/report.py`; any thread may
call it once the run is over.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from loadtest.records import RunResult
from loadtest.report import CPU_BOUND_FRACTION, Arrays, Summary
from loadtest.stats import LogBuckets, rolling_percentile

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
