"""What people watching a batch see: a progress bar or periodic lines, and a summary.

Formatting is pure (tested as text); ``ProgressDisplay`` only decides when to write.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from app.batchclient.stats import BatchStats


@dataclass(frozen=True, slots=True)
class JobProgress:
    """A batch job at one moment: ``total`` lines in the input (None: not yet counted)."""

    total: int | None
    already_done: int  # lines skipped: their id was in OUTPUT or errors, or seen before
    invalid: int  # lines that are not a request (written to errors without a request)
    elapsed_s: float
    stats: BatchStats

    @property
    def finished_this_run(self) -> int:
        return self.stats.lines_ok + self.stats.lines_failed + self.invalid

    @property
    def done(self) -> int:
        return self.already_done + self.finished_this_run

    @property
    def lines_per_s(self) -> float:
        return self.finished_this_run / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if self.total is None or self.lines_per_s <= 0:
            return None
        return max(0, self.total - self.done) / self.lines_per_s


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "--"
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _counts(progress: JobProgress) -> str:
    stats = progress.stats
    return (
        f"{progress.lines_per_s:,.0f} lines/s  ETA {_duration(progress.eta_s)}  "
        f"429s {stats.throttled:,}  retries {stats.retries:,}  "
        f"concurrency {stats.concurrency}"
    )


def progress_bar(progress: JobProgress, width: int = 24) -> str:
    """``[#####-----]  45,000/100,000  45.0%  812 lines/s  ETA 1m08s  429s 3 ...``"""
    total = progress.total
    if total:
        fraction = min(1.0, progress.done / total)
        filled = int(fraction * width)
        bar = "#" * filled + "-" * (width - filled)
        head = f"[{bar}] {progress.done:,}/{total:,} {fraction:6.1%}"
    else:
        head = f"{progress.done:,} lines"
    return f"{head}  {_counts(progress)}"


def progress_line(progress: JobProgress) -> str:
    """The same facts as the bar, as a plain line for logs."""
    total = f"/{progress.total:,}" if progress.total is not None else ""
    errors = progress.stats.lines_failed + progress.invalid
    return (
        f"batch: {progress.done:,}{total} lines done "
        f"(ok {progress.stats.lines_ok:,}, errors {errors:,}"
        f", skipped {progress.already_done:,})  {_counts(progress)}"
    )


def summary(progress: JobProgress, stopped_by: str | None) -> dict[str, Any]:
    """The ``--summary-json`` document; the table shows the same keys."""
    stats = progress.stats
    # Lines not yet in OUTPUT or errors: those read and abandoned on a stop, and those
    # never read.
    unfinished = (
        progress.total - progress.done if progress.total is not None else stats.lines_unfinished
    )
    statuses = {str(status): count for status, count in sorted(stats.statuses.items())}
    return {
        "lines_total": progress.total,
        "lines_ok": stats.lines_ok,
        "lines_failed": stats.lines_failed + progress.invalid,
        "lines_skipped": progress.already_done,
        "lines_unfinished": unfinished,
        "requests": stats.requests,
        "statuses": statuses,
        "throttled_429": stats.throttled,
        "retries": stats.retries,
        "resets": stats.resets,
        "timeouts": stats.timeouts,
        "elapsed_s": round(progress.elapsed_s, 3),
        "lines_per_s": round(progress.lines_per_s, 1),
        "latency_p50_ms": _ms(stats.latency_p50_s),
        "latency_p99_ms": _ms(stats.latency_p99_s),
        "concurrency_final": stats.concurrency,
        "concurrency_lowest": stats.lowest_concurrency,
        "concurrency_highest": stats.highest_concurrency,
        "concurrency_cuts": stats.concurrency_cuts,
        "stopped_by": stopped_by,
        "complete": stopped_by is None and unfinished == 0,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 2)


def summary_table(document: dict[str, Any]) -> str:
    rows = [(key, _cell(value)) for key, value in document.items()]
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"  {key.ljust(width)}  {value}" for key, value in rows)


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v:,}" for k, v in value.items()) or "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "-" if value is None else str(value)


class ProgressDisplay:
    """Writes a redrawn bar (``bar``), a line every ``interval_s`` (``lines``) or nothing.

    ``tick`` is called often (every ~0.5 s) from the event loop; it writes when due.
    """

    def __init__(
        self,
        stream: TextIO,
        mode: str,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in ("bar", "lines", "off"):
            raise ValueError(f"unknown progress mode {mode!r}")
        self._stream = stream
        self._mode = mode
        self._interval_s = interval_s
        self._clock = clock
        self._next_line_at = clock() + interval_s
        self._drawn = False

    def tick(self, progress: JobProgress) -> None:
        if self._mode == "bar":
            self._stream.write("\r" + progress_bar(progress) + "\x1b[K")
            self._stream.flush()
            self._drawn = True
        elif self._mode == "lines" and self._clock() >= self._next_line_at:
            self._next_line_at = self._clock() + self._interval_s
            self._stream.write(progress_line(progress) + "\n")
            self._stream.flush()

    def close(self, progress: JobProgress) -> None:
        """Draw the final state (a bar ends with its newline)."""
        if self._mode == "bar":
            self.tick(progress)
            self._stream.write("\n")
        elif self._mode == "lines":
            self._stream.write(progress_line(progress) + "\n")
        self._stream.flush()
