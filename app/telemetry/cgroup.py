"""How many CPUs this container may use, from its cgroup quota rather than the host's cores.

A container limited to 2 CPUs on a 64-core host that sizes torch's pools to 64 threads
gets throttled every CFS period: the thread-pool starvation incident. Readers take the
cgroup root as an argument so tests can point them at a fake tree.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_path(self_cgroup: Path, v2: bool) -> list[str]:
    """This process's cgroup, relative to its hierarchy's root, as path parts (from
    /proc/self/cgroup: `0::/path` on v2, `N:cpu,cpuacct:/path` on v1); none when unknown
    or at the root (a container with its own cgroup namespace sees `/`)."""
    for line in (_read(self_cgroup) or "").splitlines():
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if (v2 and controllers == "") or (not v2 and "cpu" in controllers.split(",")):
            return [part for part in path.split("/") if part and part != ".."]
    return []


def _chain(base: Path, parts: list[str]) -> list[Path]:
    """`base/parts...`, then each parent up to `base`: every cgroup whose limit applies."""
    return [base.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _v2_quota(directory: Path) -> float | None:
    text = _read(directory / "cpu.max")
    if text is None:
        return None
    quota, _, period = text.partition(" ")
    return None if quota == "max" or not period else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    quota_text = _read(directory / "cpu.cfs_quota_us")
    period_text = _read(directory / "cpu.cfs_period_us")
    if quota_text is None or period_text is None or int(quota_text) <= 0:
        return None
    return int(quota_text) / int(period_text)


def cpu_cgroups(
    root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP
) -> list[tuple[Path, bool, float | None]]:
    """This process's cpu cgroup and each of its ancestors up to the root, deepest first:
    (directory, whether it is cgroup v2, its own quota in CPUs or None). Not only the
    root: without a cgroup namespace of its own (a systemd unit's `CPUQuota=`,
    `--cgroupns=host`) the process's limit is set on its own cgroup, below the root."""
    if (root / "cgroup.controllers").exists() or (root / "cpu.max").exists():
        return [(d, True, _v2_quota(d)) for d in _chain(root, _own_path(self_cgroup, v2=True))]
    parts = _own_path(self_cgroup, v2=False)
    return [
        (directory, False, _v1_quota(directory))
        for name in ("cpu,cpuacct", "cpu")
        for directory in _chain(root / name, parts)
    ]


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """CPUs allowed by the tightest quota on this process's cgroup and its ancestors (v2
    `cpu.max`, else v1 `cpu.cfs_quota_us`), None if unlimited."""
    quotas = [quota for _, _, quota in cpu_cgroups(root, self_cgroup) if quota is not None]
    return min(quotas, default=None)


def _affinity() -> int:
    """CPUs this process may be scheduled on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def available_cpus(root: Path = CGROUP_ROOT, affinity: int | None = None) -> int:
    """Whole CPUs this process may use: the quota rounded up, bounded by its CPU affinity
    (this process's, unless `affinity` is given)."""
    allowed = affinity if affinity is not None else _affinity()
    quota = cgroup_cpu_quota(root)
    if quota is None:
        return allowed
    return max(1, min(allowed, math.ceil(quota)))
