"""Percentile, histogram and rolling-percentile math of the load generator, against numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadtest.stats import (
    LogBuckets,
    LogHistogram,
    nearest_rank,
    p99_sample_note,
    percentile_of_sorted,
    percentiles,
    rolling_percentile,
)

QUANTILES = [0.0, 1.0, 10.0, 25.0, 50.0, 90.0, 95.0, 99.0, 99.9, 100.0]


def _samples() -> dict[str, list[float]]:
    rng = np.random.default_rng(7)
    return {
        "one": [0.042],
        "two": [0.010, 0.030],
        "ties": [0.005] * 50 + [0.5] * 3,
        "uniform": rng.uniform(0.001, 0.2, size=1001).tolist(),
        "lognormal_tail": rng.lognormal(mean=math.log(0.01), sigma=1.2, size=20_000).tolist(),
    }


@pytest.mark.parametrize("name", sorted(_samples()))
def test_percentiles_equal_numpy_linear(name: str) -> None:
    values = _samples()[name]
    ours = percentiles(values, QUANTILES)
    expected = np.percentile(np.array(values), QUANTILES)
    for q, value in zip(QUANTILES, expected, strict=True):
        assert ours[q] == pytest.approx(float(value), rel=1e-12, abs=1e-15)


def test_percentile_interpolates_between_neighbours() -> None:
    # rank (4-1)*0.5 = 1.5: halfway between the 2nd and 3rd values.
    assert percentile_of_sorted([1.0, 2.0, 4.0, 8.0], 50.0) == 3.0
    assert percentile_of_sorted([1.0, 2.0, 4.0, 8.0], 100.0) == 8.0


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile_of_sorted([], 50.0)
    with pytest.raises(ValueError):
        percentile_of_sorted([1.0], 100.5)


def test_nearest_rank_p99_of_100_is_the_99th_value_not_the_max() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # unsorted: 100 down to 1
    assert nearest_rank(values, 0.99) == 99.0
    assert nearest_rank(values, 1.0) == 100.0
    assert nearest_rank(values, 0.0) == 1.0  # rank 0 clamps to the first


def test_nearest_rank_p50_of_two_is_the_first() -> None:
    assert nearest_rank([0.030, 0.010], 0.5) == 0.010


def test_nearest_rank_is_not_pushed_up_by_float_noise() -> None:
    # 0.07 * 100 is 7.000000000000001 in floats: the rank is still the 7th, not the 8th.
    assert nearest_rank([float(v) for v in range(1, 101)], 0.07) == 7.0


def test_nearest_rank_of_nothing_is_none() -> None:
    assert nearest_rank([], 0.99) is None


def test_p99_sample_note_names_samples_under_100_only() -> None:
    assert p99_sample_note(32) == " (n=32)"
    assert p99_sample_note(100) == ""
    assert p99_sample_note(0) == ""


def test_histogram_counts_equal_numpy_on_the_same_edges() -> None:
    values = _samples()["lognormal_tail"]
    histogram = LogHistogram(LogBuckets(lowest=1e-5, highest=1e3, per_decade=20))
    histogram.extend(values)
    expected, _ = np.histogram(np.array(values), bins=np.array(histogram.edges))
    assert histogram.counts == expected.tolist()
    assert histogram.total == len(values)


def test_histogram_edges_are_geometric() -> None:
    edges = LogBuckets(lowest=1e-3, highest=10.0, per_decade=10).edges()
    assert len(edges) == 41
    ratios = np.diff(np.log10(edges))
    assert np.allclose(ratios, 0.1)
    assert edges[0] == pytest.approx(1e-3) and edges[-1] == pytest.approx(10.0)


def test_histogram_quantiles_are_within_one_bucket_of_numpy() -> None:
    values = _samples()["lognormal_tail"]
    buckets = LogBuckets(per_decade=20)
    histogram = LogHistogram(buckets)
    histogram.extend(values)
    bucket_ratio = 10 ** (1 / buckets.per_decade)
    for q in (50.0, 90.0, 99.0, 99.9):
        exact = float(np.percentile(values, q))
        approximate = histogram.quantile(q)
        assert exact / bucket_ratio <= approximate <= exact * bucket_ratio, q
    assert histogram.quantile(0.0) == min(values)
    assert histogram.quantile(100.0) == max(values)


def test_histogram_clamps_out_of_range_values_into_end_buckets() -> None:
    histogram = LogHistogram(LogBuckets(lowest=1e-3, highest=1.0, per_decade=1))
    histogram.extend([1e-9, 5.0, 0.05])
    assert histogram.counts == [1, 1, 1]


def test_rolling_percentile_equals_numpy_per_window() -> None:
    rng = np.random.default_rng(3)
    times = np.sort(rng.uniform(0.0, 10.0, size=3000))
    values = rng.exponential(0.02, size=3000)
    window, step = 1.0, 0.25
    at_times, p99s = rolling_percentile(times.tolist(), values.tolist(), window, step, 99.0)
    assert len(at_times) >= 38
    for at, ours in zip(at_times, p99s, strict=True):
        in_window = values[(times > at - window) & (times <= at)]
        assert ours == pytest.approx(float(np.percentile(in_window, 99.0)), rel=1e-12)


def test_rolling_percentile_skips_empty_windows() -> None:
    at_times, _ = rolling_percentile([0.0, 0.1, 5.0], [1.0, 2.0, 3.0], 0.5, 0.5, 50.0)
    # Windows ending at 1.0 .. 4.5 hold no sample and are left out, not drawn as zero.
    assert all(t <= 0.5 or t >= 5.0 for t in at_times)
