"""CPU throttling of this container by its cgroup quota (the CFS bandwidth controller).

cgroup v2 `cpu.stat` has `nr_periods`, `nr_throttled` and `throttled_usec`; v1 has the same
counts and `throttled_time` in nanoseconds under `cpu,cpuacct/` (or `cpu/`). The kernel
adds each CPU's throttled time to that total (`unthrottle_cfs_rq`), so it is CPU time: a
20 ms throttle of a 4-CPU quota counts up to 80 ms. The probe also reads the quota
(`cgroup_quota_cpus`, a level), which turns it back into wall time. Outside a limited
cgroup the counters stay at zero; where there is no such file the probe reads nothing. The
root is an argument so tests can point it at a fake tree.
"""

from __future__ import annotations

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


def _find(root: Path, self_cgroup: Path) -> tuple[ProcFile, Parser] | None:
    """The `cpu.stat` that counts this process's throttling, open; None if none: that of
    the cgroup holding the tightest quota on its chain (where the throttling happens),
    else the deepest that has one. The root's alone missed a limit set below it (a
    systemd unit's `CPUQuota=`, `--cgroupns=host`): the quota was found, its throttling
    never."""
    chain = cpu_cgroups(root, self_cgroup)
    limited = sorted((c for c in chain if c[2] is not None), key=lambda c: c[2] or 0.0)
    roots = [(root, True, None), (root / "cpu,cpuacct", False, None), (root / "cpu", False, None)]
    for directory, v2, _ in [*limited, *chain, *roots]:
        parse = _v2 if v2 else _v1
        file = ProcFile(directory / "cpu.stat")
        text = file.text()
        if text is not None and parse(text) is not None:
            return file, parse
        file.close()
    return None


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
        self._source: tuple[ProcFile, Parser] | None = None
        self._quota: float | None = None
        self._looked = False
        self._cached = Cached(self._read, max_age_s)

    def _read(self) -> dict[str, float]:
        if not self._looked:
            self._source, self._looked = _find(self._root, self._self_cgroup), True
            self._quota = cgroup_cpu_quota(self._root, self._self_cgroup)
        if self._source is None:
            return {}
        file, parse = self._source
        text = file.text()
        readings = (parse(text) or {}) if text is not None else {}
        if readings and self._quota is not None:
            readings["cgroup_quota_cpus"] = self._quota
        return readings

    def read(self) -> Mapping[str, float]:
        return self._cached.read()
