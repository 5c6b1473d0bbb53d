"""Latency statistics: exact percentiles, a log-bucketed histogram and a rolling percentile.

Everything here is pure Python over plain sequences so that the progress line can use it
while a run is going, without numpy; the report converts to numpy only for plots.
Percentiles use the same definition as ``numpy.percentile(..., method="linear")`` (the
default), so figures here and in a notebook over the JSON agree to the last digit. The
benches' small samples (a wave's TTFTs, /healthz probes, an open loop's admitted requests)
use `nearest_rank` instead: a value that was observed, the same definition in every bench.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: The percentiles every report shows, in this order.
REPORTED_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0, 99.9)


def percentile_of_sorted(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, by linear interpolation.

    Matches numpy's default ("linear", type 7 of Hyndman and Fan): the rank is
    ``(n - 1) * q / 100`` and the result interpolates between its two neighbours.
    """
    if not sorted_values:
        raise ValueError("percentile of an empty sample")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0..100")
    rank = (len(sorted_values) - 1) * q / 100.0
    lower = math.floor(rank)
    upper = min(lower + 1, len(sorted_values) - 1)
    fraction = rank - lower
    low_value = sorted_values[lower]
    return low_value + (sorted_values[upper] - low_value) * fraction


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) of unsorted values by nearest rank: the ceil(q * n)-th smallest
    (clamped to the first and the last), None for no values. Of 100 values p99 is the 99th,
    not the maximum; of 2, p50 is the first."""
    if not values:
        return None
    ordered = sorted(values)
    # Rounded first so that float noise (0.07 * 100 = 7.000000000000001) cannot push the
    # rank up by one.
    rank = math.ceil(round(q * len(ordered), 9))
    return ordered[min(max(rank - 1, 0), len(ordered) - 1)]


def p99_sample_note(count: int) -> str:
    """What to print next to a p99 taken over `count` values: ` (n=count)` under 100, where
    the p99 is one of the few largest values rather than a 1-in-100 tail; else nothing."""
    return f" (n={count})" if 0 < count < 100 else ""


def percentiles(values: Iterable[float], qs: Sequence[float]) -> dict[float, float]:
    """Several percentiles of an unsorted sample, sorting it once."""
    ordered = sorted(values)
    return {q: percentile_of_sorted(ordered, q) for q in qs}


@dataclass(frozen=True, slots=True)
class LogBuckets:
    """Geometric bucket edges from ``lowest`` to ``highest`` with a fixed count per decade.

    With 20 buckets per decade, neighbouring edges differ by 12.2 %, so a quantile read
    from the histogram is within that relative error of the exact one; that is what the
    running progress line needs, and the plot's bins are the same edges.
    """

    lowest: float = 1e-5
    highest: float = 1e3
    per_decade: int = 20

    def edges(self) -> list[float]:
        decades = math.log10(self.highest / self.lowest)
        count = round(decades * self.per_decade)
        return [self.lowest * 10 ** (i / self.per_decade) for i in range(count + 1)]


class LogHistogram:
    """Counts of values in geometric buckets; values outside the range go to the end buckets.

    Bucket i holds ``edges[i] <= v < edges[i+1]``, except the last, which also holds its
    upper edge (numpy.histogram's convention), so counts equal numpy's on the same edges
    for in-range values. Cheap to update from the event loop: one bisect per value.
    """

    def __init__(self, buckets: LogBuckets | None = None) -> None:
        self.edges: list[float] = (buckets or LogBuckets()).edges()
        self.counts: list[int] = [0] * (len(self.edges) - 1)
        self.total = 0
        self.minimum = math.inf
        self.maximum = -math.inf

    def add(self, value: float) -> None:
        index = bisect.bisect_right(self.edges, value) - 1
        index = min(max(index, 0), len(self.counts) - 1)
        self.counts[index] += 1
        self.total += 1
        self.minimum = min(self.minimum, value)
        self.maximum = max(self.maximum, value)

    def extend(self, values: Iterable[float]) -> None:
        for value in values:
            self.add(value)

    def quantile(self, q: float) -> float:
        """Approximate q-th percentile (0..100): the geometric middle of the bucket holding it.

        Clamped to the observed minimum and maximum, so q=0 and q=100 are exact.
        """
        if self.total == 0:
            raise ValueError("quantile of an empty histogram")
        if q <= 0.0:
            return self.minimum
        if q >= 100.0:
            return self.maximum
        # Same rank as the exact definition, rounded up to a whole observation.
        wanted = math.floor((self.total - 1) * q / 100.0) + 1
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= wanted:
                middle = math.sqrt(self.edges[index] * self.edges[index + 1])
                return min(max(middle, self.minimum), self.maximum)
        return self.maximum


def rolling_percentile(
    times: Sequence[float], values: Sequence[float], window_s: float, step_s: float, q: float
) -> tuple[list[float], list[float]]:
    """The q-th percentile of ``values`` over a trailing window, evaluated every ``step_s``.

    ``times`` must be sorted ascending (they are request start times). Returns the
    evaluation times and the percentile at each; a window with no sample is skipped
    rather than drawn as zero, so gaps in the line show gaps in traffic.
    """
    if len(times) != len(values):
        raise ValueError("times and values differ in length")
    if window_s <= 0 or step_s <= 0:
        raise ValueError("window and step must be positive")
    out_times: list[float] = []
    out_values: list[float] = []
    if not times:
        return out_times, out_values
    steps = math.ceil((times[-1] - times[0]) / step_s) + 1
    for step in range(1, steps + 1):
        # Multiplying rather than accumulating keeps the grid free of rounding drift.
        at = times[0] + step * step_s
        low = bisect.bisect_right(times, at - window_s)
        high = bisect.bisect_right(times, at)
        if high > low:
            out_times.append(at)
            out_values.append(percentile_of_sorted(sorted(values[low:high]), q))
    return out_times, out_values
