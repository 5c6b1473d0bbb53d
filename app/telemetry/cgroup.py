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


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs allowed by the quota (v2 `cpu.max`, else v1 `cpu.cfs_quota_us`), None if unlimited."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota == "max" or not period:
            return None
        return int(quota) / int(period)
    for v1_dir in (root / "cpu,cpuacct", root / "cpu"):
        quota_text = _read(v1_dir / "cpu.cfs_quota_us")
        period_text = _read(v1_dir / "cpu.cfs_period_us")
        if quota_text is not None and period_text is not None:
            quota_us = int(quota_text)
            return None if quota_us <= 0 else quota_us / int(period_text)
    return None


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
