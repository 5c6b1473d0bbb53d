"""Driving one load run from Python code: `execute` runs a `RunConfig` against a target on
the running event loop, `run_event_loop` starts that loop (uvloop when installed), and
`ProgressPrinter` shows the run's progress line. The command line (`loadtest/cli.py`), the
benches and the stub server call these: `run_event_loop` from a thread with no loop running
(it blocks until `main` returns), `execute` on the loop's own thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TextIO, TypeVar

from loadtest.httpclient import Target
from loadtest.records import MonitorSample, RunConfig, RunResult
from loadtest.runner import LoadRun, http_connection_factory

T = TypeVar("T")


def run_event_loop(main: Callable[[], Coroutine[Any, Any, T]], use_uvloop: bool = True) -> T:
    """Run ``main`` on uvloop when it is installed (it roughly doubles the rate one core can
    drive), else on the standard loop."""
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if use_uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main())


class ProgressPrinter:
    """The progress line: rewritten in place on a terminal, one line every few seconds in
    a log (CI output would otherwise be a wall of carriage returns)."""

    def __init__(self, stream: TextIO, duration_s: float, log_every_s: float = 5.0) -> None:
        self._stream = stream
        self._duration_s = duration_s
        self._interactive = stream.isatty()
        self._log_every_s = log_every_s
        self._last_logged = -log_every_s

    def __call__(self, sample: MonitorSample, run: LoadRun) -> None:
        recorder = run.recorder
        p99 = "-" if sample.latency_p99_s is None else f"{sample.latency_p99_s * 1000:.1f} ms"
        line = (
            f"[{sample.elapsed_s:6.1f}/{self._duration_s:.0f}s] "
            f"done {len(recorder)} | {sample.ok / sample.interval_s:7.1f} 2xx/s | p99 {p99} | "
            f"429 {sample.rejected_429} err {sample.errors - sample.rejected_429} | "
            f"in flight {sample.in_flight} queued {sample.backlog} | "
            f"cpu {sample.cpu_fraction:.0%}"
        )
        if self._interactive:
            self._stream.write("\r\x1b[2K" + line)
            self._stream.flush()
        elif sample.elapsed_s - self._last_logged >= self._log_every_s:
            self._last_logged = sample.elapsed_s
            self._stream.write(line + "\n")
            self._stream.flush()

    def finish(self) -> None:
        if self._interactive:
            self._stream.write("\n")
            self._stream.flush()


async def execute(
    config: RunConfig,
    target: Target,
    payloads: Sequence[bytes],
    progress: ProgressPrinter | None = None,
    connect_timeout_s: float = 10.0,
) -> RunResult:
    """One run against ``target`` on the running loop."""
    run = LoadRun(
        config,
        payloads,
        http_connection_factory(target, connect_timeout_s),
        on_progress=progress,
    )
    try:
        return await run.run()
    finally:
        if progress is not None:
            progress.finish()
