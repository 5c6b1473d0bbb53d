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
from app.telemetry.procfile import ProcFile

PROC = Path("/proc")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _host_busy_seconds(text: str | None) -> float | None:
    fields = text.split("\n", 1)[0].split() if text else []
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / _TICKS_PER_S


def _resident_bytes(text: str | None) -> float | None:
    try:
        return int(text.split()[1]) * _PAGE_BYTES if text else None
    except (IndexError, ValueError):
        return None


def host_busy_cpu_seconds(proc: Path = PROC) -> float | None:
    """CPU seconds every CPU of the host spent on anything but idle and iowait, since boot."""
    return _host_busy_seconds(ProcFile(proc / "stat", 512).text())


class CpuProbe:
    """`process_cpu_seconds_total` (read each time: a clock call),
    `host_cpu_busy_seconds_total` (cached `max_age_s`: the kernel counts it in 10 ms ticks
    anyway) and `process_resident_bytes` (cached a second: for the metric only). Its files
    stay open (`ProcFile`)."""

    def __init__(self, proc: Path = PROC, max_age_s: float = 0.01) -> None:
        # The first line is all that is needed of /proc/stat (the kernel writes it all).
        self._stat = ProcFile(proc / "stat", 512)
        self._statm = ProcFile(proc / "self" / "statm", 256)
        self._host = Cached(self._read_host, max_age_s)
        self._rss = Cached(self._read_rss, 1.0)

    def _read_host(self) -> Mapping[str, float]:
        host = _host_busy_seconds(self._stat.text())
        return {} if host is None else {"host_cpu_busy_seconds_total": host}

    def _read_rss(self) -> Mapping[str, float]:
        rss = _resident_bytes(self._statm.text())
        return {} if rss is None else {"process_resident_bytes": rss}

    def read(self) -> Mapping[str, float]:
        return {
            "process_cpu_seconds_total": time.process_time(),
            **self._host.read(),
            **self._rss.read(),
        }
