"""CPU time during a bench, read from /proc: `system_busy_s`, every process's CPU since boot;
`own_cpu_s`, the CPU of the bench, its finished children and its server's process tree; and
`ForeignLoad`, the cores other processes used while a phase ran (and those the server's
process tree used). On a shared machine other work slows a phase, so each bench reports it.
Call from the bench's own thread.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path

from loadtest.proctree import cpu_seconds, descendants

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def system_busy_s() -> float:
    """CPU seconds all processes have used since boot (Linux /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICKS_PER_S


def own_cpu_s(server_pid: int) -> float:
    """CPU seconds of this bench process, of its children it has waited for (a load
    generator, wrk, a client) and of the server `server_pid` with every process below it
    (`steadyserve serve` is a supervisor with an engine and front ends as children). Read
    before and after a phase: what the system was busy with besides is other processes'."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = resource.getrusage(resource.RUSAGE_SELF)
    tree = sum(cpu_seconds(pid) for pid in descendants(server_pid))
    return tree + children.ru_utime + children.ru_stime + mine.ru_utime + mine.ru_stime


class ForeignLoad:
    """Cores used by processes other than the bench and its server (with the server's
    children: `steadyserve serve` runs an engine and front ends) during a phase, and the
    cores the server itself used.

    On a shared 2-core machine other work slows every phase, torch most of all (its
    threads wait for each other when one is descheduled), so each phase reports it.
    """

    def __init__(self, pids: Sequence[int]) -> None:
        # Once each: the server is also a descendant of the bench's own process.
        self._pids = list(dict.fromkeys(p for pid in pids for p in descendants(pid)))
        self._started = time.monotonic()
        self._busy = system_busy_s()
        self._cpu = {pid: self._cpu_s(pid) for pid in self._pids}

    @staticmethod
    def _cpu_s(pid: int) -> float:
        try:
            return cpu_seconds(pid)
        except (OSError, ValueError, IndexError):
            return 0.0

    def _own_s(self, pids: Sequence[int]) -> float:
        return sum(self._cpu_s(pid) - self._cpu[pid] for pid in pids)

    def cores(self) -> float | None:
        try:
            busy = system_busy_s() - self._busy
        except (OSError, ValueError, IndexError):
            return None
        wall = max(time.monotonic() - self._started, 1e-9)
        return max(busy - self._own_s(self._pids), 0.0) / wall

    def cores_of(self, pid: int) -> float:
        """Cores `pid` and its descendants (as found at the start) used."""
        tree = [p for p in self._pids if p in descendants(pid)]
        wall = max(time.monotonic() - self._started, 1e-9)
        return self._own_s(tree) / wall
