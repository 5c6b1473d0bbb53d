"""CPU throttling of this container by its cgroup quota (the CFS bandwidth controller).

cgroup v2 `cpu.stat` has `nr_periods`, `nr_throttled` and `throttled_usec`; v1 has the same
counts and `throttled_time` in nanoseconds under `cpu,cpuacct/` (or `cpu/`). The kernel
throttles the group's runqueue on each CPU where it ran out of runtime and adds each one's
throttled time to that total when it is unthrottled (`unthrottle_cfs_rq`), so it is summed
over the CPUs the group's threads ran on, which the quota does not bound: a 20 ms throttle
of a 2-CPU quota whose threads ran on 9 CPUs counts up to 180 ms. `nr_throttled` counts the
periods in which it throttled, each throttle lasting at most until the next period's
refill. So the wall time throttled is at least the total over the CPUs this process may run
on (`allowed_cpus`, its affinity) and at most the throttled periods times the period
(`cgroup_period_seconds`): levels the probe reads with the quota (`cgroup_quota_cpus`), for
attribution to turn the total back into wall time. Outside a limited cgroup the counters
stay at zero; where there is no such file the probe reads nothing. The root is an argument
so tests can point it at a fake tree.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from app.telemetry.cgroup import CGROUP_ROOT, SELF_CGROUP, cgroup_cpu_quota, cpu_cgroups
from app.telemetry.probe import Cached
from app.telemetry.procfile import ProcFile


def _fields(text: str) -> dict[str, int]:
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            fields[name] = int(value)
    return fields


Parser = Callable[[str], dict[str, float] | None]


def _parser(throttled_key: str, units_per_second: float) -> Parser:
    """A `cpu.stat` parser for the layout whose throttled time is `throttled_key` (v2:
    `throttled_usec`, v1: `throttled_time` in ns); None where the text has no such field."""

    def parse(text: str) -> dict[str, float] | None:
        fields = _fields(text)
        if throttled_key not in fields:
            return None
        return {
            "cgroup_periods_total": fields.get("nr_periods", 0),
            "cgroup_throttled_periods_total": fields.get("nr_throttled", 0),
            "cgroup_throttled_seconds_total": fields[throttled_key] / units_per_second,
        }

    return parse


_v2 = _parser("throttled_usec", 1e6)
_v1 = _parser("throttled_time", 1e9)


def _find(root: Path, self_cgroup: Path) -> tuple[ProcFile, Parser, float | None] | None:
    """The `cpu.stat` that counts this process's throttling, open, and its cgroup's CFS
    period in seconds (None without a quota there); None if none: that of the cgroup
    holding the tightest quota on its chain (where the throttling happens), else the
    deepest that has one. The root's alone missed a limit set below it (a systemd unit's
    `CPUQuota=`, `--cgroupns=host`): the quota was found, its throttling never."""
    chain = cpu_cgroups(root, self_cgroup)
    limited = sorted((c for c in chain if c[2] is not None), key=lambda c: c[2] or 0.0)
    roots = [(root, True, None), (root / "cpu,cpuacct", False, None), (root / "cpu", False, None)]
    for directory, v2, quota in [*limited, *chain, *roots]:
        parse = _v2 if v2 else _v1
        file = ProcFile(directory / "cpu.stat")
        text = file.text()
        if text is not None and parse(text) is not None:
            return file, parse, _period_s(directory, v2) if quota is not None else None
        file.close()
    return None


def _period_s(directory: Path, v2: bool) -> float | None:
    """The CFS period of the quota set on `directory` (v2 `cpu.max`, v1
    `cpu.cfs_period_us`), in seconds; None if unreadable."""
    try:
        if v2:
            period = (directory / "cpu.max").read_text().split()[1]
        else:
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        return int(period) / 1e6
    except (OSError, IndexError, ValueError):
        return None


def _allowed_cpus() -> int:
    """CPUs this process may run on (in a container, its cpuset: its group's threads'
    too): the summed throttled time over them never overstates the wall time."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def read_throttling(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> dict[str, float]:
    """Periods, throttled periods and throttled seconds since the cgroup was created."""
    return dict(CgroupThrottleProbe(root, max_age_s=0.0, self_cgroup=self_cgroup).read())


class CgroupThrottleProbe:
    """Finds its file once (a cgroup's layout does not change under a running process) and
    re-reads it at most every `max_age_s`."""

    def __init__(
        self, root: Path = CGROUP_ROOT, max_age_s: float = 0.01, self_cgroup: Path = SELF_CGROUP
    ) -> None:
        self._root = root
        self._self_cgroup = self_cgroup
        self._source: tuple[ProcFile, Parser, float | None] | None = None
        self._quota: float | None = None
        self._cpus = 0
        self._looked = False
        self._cached = Cached(self._read, max_age_s)

    def _read(self) -> dict[str, float]:
        if not self._looked:
            self._source, self._looked = _find(self._root, self._self_cgroup), True
            self._quota = cgroup_cpu_quota(self._root, self._self_cgroup)
            self._cpus = _allowed_cpus()
        if self._source is None:
            return {}
        file, parse, period_s = self._source
        text = file.text()
        readings = (parse(text) or {}) if text is not None else {}
        if readings and self._quota is not None:
            readings["cgroup_quota_cpus"] = self._quota
            readings["allowed_cpus"] = self._cpus
            if period_s is not None:
                readings["cgroup_period_seconds"] = period_s
        return readings

    def read(self) -> Mapping[str, float]:
        return self._cached.read()
