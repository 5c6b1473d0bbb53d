"""A high-water mark kept over a window longer than a scrape interval."""

from __future__ import annotations

from app.telemetry.recent_max import RecentMax


def test_a_peak_stays_in_the_mark_for_the_whole_window_then_leaves() -> None:
    """Reset every 0.25 s refresh, a 15 s scrape saw only the last quarter second."""
    mark = RecentMax(window_s=30.0)
    assert mark.roll(0.25, 900) == 900  # a spike
    now = 0.25
    while now < 30.0:  # quiet refreshes every 0.25 s for the rest of the window
        now += 0.25
        assert mark.roll(now, 2) == 900, now
    assert mark.roll(now + 0.25, 2) == 2  # past the window: gone
