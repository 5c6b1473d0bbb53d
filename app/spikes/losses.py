"""What each process lost over a slow request, counted only where it could have delayed the
request: its collections' pauses, its event loop blocked by other work or starved of a CPU
(`process_loss`), and the cgroup's throttling as wall time (`cgroup_throttling`). Pure, fed
the probes' changes over the request; `attribution` ranks the causes (docs/SPIKES.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# The engine's phases, and the front end's own: a process's loss could delay the request
# only while the request was on that process's side.
ENGINE_PHASES = ("queue", "compute", "engine_lost")
FRONT_END_PHASES = ("parse_body", "tokenize", "admission", "serialise")


def phases_sum(phases: Mapping[str, float], names: tuple[str, ...]) -> float:
    return sum(phases.get(name, 0.0) for name in names)


@dataclass(frozen=True, slots=True)
class ProcessLoss:
    """A process's time lost over the request, each part at most what could have delayed
    it (`process_loss`): its collections' pauses, its event loop blocked by other work, and
    that loop's thread waiting for a CPU; `gc_measured`: all of its pauses."""

    gc: float = 0.0
    blocked: float = 0.0
    starved: float = 0.0
    gc_measured: float = 0.0

    @property
    def largest(self) -> float:
        return max(self.gc, self.blocked, self.starved)

    @property
    def total(self) -> float:
        return self.gc + self.blocked + self.starved


def process_loss(probes: Mapping[str, float], window_s: float, own_s: float = 0.0) -> ProcessLoss:
    """The lost time `probes` show, at most `window_s`: the request's time on this process's
    side (a front end's 180 ms collection while the engine computed delayed it not at all).
    `own_s`: the request's own work on this process's loop, which made its ticker late too
    and is a phase of its own, not a blocked loop."""
    gc = sum(probes.get(f"gc_gen{g}_pause_seconds_total", 0.0) for g in (2, 1, 0))
    busy = probes.get("loop_busy_lag_seconds_total", 0.0)
    lag = probes.get("loop_lag_seconds_total", 0.0)
    # A collection on the loop's thread shows up as lag too, and a CPU taken from it
    # while it collects as starvation: both are the GC's pause (timed by the clock).
    blocked = max(0.0, busy - gc - own_s)
    starved = max(0.0, lag - busy - max(0.0, gc - busy))
    gc_in = min(gc, window_s)
    # Other work cannot have held the loop while it ran this request's own.
    blocked_in = min(blocked, window_s - gc_in, max(0.0, window_s - own_s))
    starved_in = min(starved, window_s - gc_in - blocked_in)
    return ProcessLoss(gc_in, blocked_in, starved_in, gc)


@dataclass(frozen=True, slots=True)
class Throttling:
    """The cgroup's throttling over the request: `seconds` of wall time (never more than
    it was), from `cpu_seconds` summed over the group's runqueues, over `cpus` CPUs, in
    `periods` CFS periods."""

    seconds: float
    cpu_seconds: float
    cpus: int
    periods: int


def cgroup_throttling(processes: list[Mapping[str, float]], total_s: float) -> Throttling:
    """From each process's probe changes (`app/telemetry/throttling.py`): the largest."""

    def largest(key: str) -> float:
        return max((p.get(key, 0.0) for p in processes), default=0.0)

    throttled_cpu = largest("cgroup_throttled_seconds_total")
    periods = largest("cgroup_throttled_periods_total")
    # The kernel sums the throttled time of the group's runqueue on each CPU its threads
    # ran on (the quota does not bound them): the wall time is at least that over the CPUs
    # they may run on; without them, over the quota's. And a throttle lasts at most until
    # the next period's refill.
    cpus = max(1, int(largest("allowed_cpus")) or math.ceil(largest("cgroup_quota_cpus")))
    throttled = throttled_cpu / cpus
    period_s = largest("cgroup_period_seconds")
    if period_s > 0:
        throttled = min(throttled, periods * period_s)
    return Throttling(min(throttled, total_s), throttled_cpu, cpus, int(periods))
