"""CPU time of this process and of the whole host, and this process's resident memory.

The host's busy CPU time minus this process's own is what *other* processes took while a
request ran ("other processes took 0.9 cores"). Readers take their paths as arguments so
tests can point them at fake files; readings are cached for a few milliseconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from app.telemetry.probe import Cached

PROC = Path("/proc")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_busy_cpu_seconds(proc: Path = PROC) -> float | None:
    """CPU seconds every CPU of the host spent on anything but idle and iowait, since boot."""
    try:
        with (proc / "stat").open() as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / _TICKS_PER_S


def resident_bytes(proc: Path = PROC) -> float | None:
    try:
        with (proc / "self" / "statm").open() as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


class CpuProbe:
    """`process_cpu_seconds_total` (read each time: a clock call),
    `host_cpu_busy_seconds_total` (cached `max_age_s`: the kernel counts it in 10 ms ticks
    anyway) and `process_resident_bytes` (cached a second: for the metric only)."""

    def __init__(self, proc: Path = PROC, max_age_s: float = 0.01) -> None:
        self._proc = proc
        self._host = Cached(self._read_host, max_age_s)
        self._rss = Cached(self._read_rss, 1.0)

    def _read_host(self) -> Mapping[str, float]:
        host = host_busy_cpu_seconds(self._proc)
        return {} if host is None else {"host_cpu_busy_seconds_total": host}

    def _read_rss(self) -> Mapping[str, float]:
        rss = resident_bytes(self._proc)
        return {} if rss is None else {"process_resident_bytes": rss}

    def read(self) -> Mapping[str, float]:
        return {
            "process_cpu_seconds_total": time.process_time(),
            **self._host.read(),
            **self._rss.read(),
        }
