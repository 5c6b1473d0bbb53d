"""How long the calling thread has waited, runnable, for a CPU (Linux schedstat: the second
field of /proc/thread-self/schedstat, in nanoseconds). A thread that waits on a lock, a
sleep or a CUDA stream is not runnable and does not count: this is time taken from it by
other threads and processes (or by a cgroup quota). 0.0 where the kernel does not say.

Any thread may call it, about for itself; a few microseconds (one small file read).
"""

from __future__ import annotations

from pathlib import Path

SCHEDSTAT = Path("/proc/thread-self/schedstat")
_available = SCHEDSTAT.exists()


def thread_runqueue_wait_s() -> float:
    if not _available:
        return 0.0
    try:
        with SCHEDSTAT.open("rb") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
