"""CPU throttling of this container by its cgroup quota (the CFS bandwidth controller).

cgroup v2 `cpu.stat` has `nr_periods`, `nr_throttled` and `throttled_usec`; v1 has the same
counts and `throttled_time` in nanoseconds under `cpu,cpuacct/` (or `cpu/`). Outside a
limited cgroup the counters stay at zero; where there is no such file the probe reads
nothing. The root is an argument so tests can point it at a fake tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from app.telemetry.cgroup import CGROUP_ROOT
from app.telemetry.probe import Cached


def _fields(path: Path) -> dict[str, int] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            fields[name] = int(value)
    return fields


def read_throttling(root: Path = CGROUP_ROOT) -> dict[str, float]:
    """Periods, throttled periods and throttled seconds since the cgroup was created."""
    v2 = _fields(root / "cpu.stat")
    if v2 is not None and "throttled_usec" in v2:
        return {
            "cgroup_periods_total": v2.get("nr_periods", 0),
            "cgroup_throttled_periods_total": v2.get("nr_throttled", 0),
            "cgroup_throttled_seconds_total": v2["throttled_usec"] / 1e6,
        }
    for v1_dir in (root / "cpu,cpuacct", root / "cpu"):
        v1 = _fields(v1_dir / "cpu.stat")
        if v1 is not None and "throttled_time" in v1:
            return {
                "cgroup_periods_total": v1.get("nr_periods", 0),
                "cgroup_throttled_periods_total": v1.get("nr_throttled", 0),
                "cgroup_throttled_seconds_total": v1["throttled_time"] / 1e9,
            }
    return {}


class CgroupThrottleProbe:
    def __init__(self, root: Path = CGROUP_ROOT, max_age_s: float = 0.01) -> None:
        self._cached = Cached(lambda: read_throttling(root), max_age_s)

    def read(self) -> Mapping[str, float]:
        return self._cached.read()
