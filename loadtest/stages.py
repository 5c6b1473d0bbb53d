"""Load stages and open-loop arrival schedules.

A stage is a duration and a target that either holds (``20s:500``) or moves linearly
(``30s:50-5000``). In open-loop mode the target is an arrival rate (requests per second);
in closed-loop mode it is a number of concurrent connections. The same stage text drives
the locustfile's ``LoadTestShape``, where the target is a number of users.

Arrival times are computed from the cumulative rate Lambda(t) = integral of rate(t): the
k-th request of a *constant* process arrives at Lambda^-1(k); a *Poisson* process (a
non-homogeneous one while a ramp moves the rate) uses unit-rate exponential gaps instead of
unit steps. Either way the whole schedule is fixed before a request is sent, which is
what makes the generator open-loop.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str) -> float:
    """Seconds in ``"500ms"``, ``"20s"``, ``"2m"``, ``"1h"`` or a bare number of seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 500ms, 20s, 2m)")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


class Arrival(Enum):
    CONSTANT = "constant"
    POISSON = "poisson"


@dataclass(frozen=True, slots=True)
class Stage:
    """``duration_s`` seconds during which the target goes linearly from ``start`` to ``end``."""

    duration_s: float
    start: float
    end: float

    def __post_init__(self) -> None:
        if self.duration_s <= 0:
            raise ValueError(f"stage duration must be positive, got {self.duration_s}")
        if self.start < 0 or self.end < 0:
            raise ValueError("stage targets must not be negative")

    def target_at(self, elapsed_s: float) -> float:
        fraction = min(max(elapsed_s / self.duration_s, 0.0), 1.0)
        return self.start + (self.end - self.start) * fraction

    def cumulative(self) -> float:
        """Integral of the target over the stage (the expected number of arrivals)."""
        return (self.start + self.end) * self.duration_s / 2.0


def parse_stages(text: str) -> list[Stage]:
    """Parse ``"10s:50-500,30s:500,10s:500-0"`` into stages.

    A stage written with one target holds it; ``A-B`` ramps linearly from A to B.
    """
    stages: list[Stage] = []
    for part in text.split(","):
        if not part.strip():
            continue
        duration_text, sep, target_text = part.partition(":")
        if not sep:
            raise ValueError(f"stage {part!r} needs DURATION:TARGET or DURATION:FROM-TO")
        low_text, dash, high_text = target_text.partition("-")
        start = float(low_text)
        end = float(high_text) if dash else start
        stages.append(Stage(parse_duration(duration_text), start, end))
    if not stages:
        raise ValueError("no stages given")
    return stages


def total_duration(stages: Sequence[Stage]) -> float:
    return sum(stage.duration_s for stage in stages)


def target_at(stages: Sequence[Stage], elapsed_s: float) -> float:
    """The target in force ``elapsed_s`` after the start; the last one holds afterwards."""
    for stage in stages:
        if elapsed_s < stage.duration_s:
            return stage.target_at(elapsed_s)
        elapsed_s -= stage.duration_s
    return stages[-1].end


def _time_into_stage(stage: Stage, arrivals: float) -> float:
    """The time t within ``stage`` at which its cumulative rate reaches ``arrivals``.

    Solves ``start*t + (end-start)*t^2/(2*duration) = arrivals`` in the form
    ``2u / (a + sqrt(a^2 + 2(b-a)u/D))``, which is exact for a hold (b == a), has no
    division by zero for a ramp from 0, and stays accurate for a ramp down.
    """
    if arrivals <= 0.0:
        return 0.0
    a, b, d = stage.start, stage.end, stage.duration_s
    discriminant = max(a * a + 2.0 * (b - a) * arrivals / d, 0.0)
    denominator = a + math.sqrt(discriminant)
    return 2.0 * arrivals / denominator


def arrival_times(
    stages: Sequence[Stage], arrival: Arrival, seed: int | None = None
) -> Iterator[float]:
    """Scheduled send times, in seconds from the start, in ascending order.

    Lazy, so a long run at a high rate costs no memory up front. The constant process
    sends its first request at t=0.
    """
    rng = random.Random(seed)
    # Position on the unit-rate axis of the next arrival, relative to the current stage.
    next_arrival = 0.0 if arrival is Arrival.CONSTANT else rng.expovariate(1.0)
    stage_offset = 0.0
    for stage in stages:
        stage_arrivals = stage.cumulative()
        while next_arrival < stage_arrivals:
            yield stage_offset + _time_into_stage(stage, next_arrival)
            next_arrival += 1.0 if arrival is Arrival.CONSTANT else rng.expovariate(1.0)
        next_arrival -= stage_arrivals
        stage_offset += stage.duration_s
