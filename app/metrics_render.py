"""/metrics in multiprocess mode (`steadyserve serve`): every process's values, merged from
prometheus_client's multiprocess directory, on each front end (`Metrics.render`) and on the
supervisor's probe port (`scrape_processes`). The instruments are in `app/metrics.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from app.metrics_archive import MULTIPROCESS_DIR_ENV, scrape_lock

# A multiprocess file's used-bytes word and padding, before its first value.
_MMAP_HEADER_BYTES = 8


def render_processes() -> bytes:
    """Every process's metrics, merged from the multiprocess directory: /metrics under
    `steadyserve serve`, on each front end and on the supervisor's probe port. Any thread."""
    merged = CollectorRegistry()
    merged.register(_WrittenFilesCollector(os.environ[MULTIPROCESS_DIR_ENV]))
    return generate_latest(merged)


async def scrape_processes() -> bytes:
    """`render_processes` off the event loop (the supervisor's /metrics)."""
    return await asyncio.to_thread(render_processes)


class _WrittenFilesCollector(Collector):
    """prometheus_client's multiprocess collector over the files that hold at least their
    header. The library creates a process's file empty and sizes it just after: a scrape
    in between, or a file left so by a process killed in between, failed every /metrics
    (client_python issue 1199). Dead processes' files are folded into archives meanwhile
    (app/metrics_archive.py): the scrape holds their lock, so it sees each value once."""

    def __init__(self, directory: str) -> None:
        self._directory = directory

    def collect(self) -> Iterable[Metric]:
        with scrape_lock(self._directory):
            written = []
            for path in glob.glob(os.path.join(self._directory, "*.db")):
                with contextlib.suppress(FileNotFoundError):  # a dead process's, just removed
                    if os.path.getsize(path) >= _MMAP_HEADER_BYTES:
                        written.append(path)
            # A list: the merge reads the files now, under the lock, not when iterated.
            merged = list(MultiProcessCollector.merge(written, accumulate=True))  # type: ignore[no-untyped-call]
        return merged
