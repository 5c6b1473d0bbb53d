"""High-water marks a scrape cannot miss.

The engine refreshes its gauges every 0.25 s and Prometheus scrapes every 15 s: a mark that
started afresh at each refresh showed a scrape only the last 0.25 s before it, so a queue
spike (or a long event-loop stall) between two scrapes was never seen. Pure; one thread
(its owner's).
"""

from __future__ import annotations

from collections import deque

# Over twice the ServiceMonitor's 15 s scrape interval: a peak stays in the mark until a
# scrape has read it, whatever the scrapes' jitter.
HIGH_WATER_WINDOW_S = 30.0


class RecentMax:
    """The largest value of the last `window_s`, from one maximum per `roll`."""

    def __init__(self, window_s: float = HIGH_WATER_WINDOW_S) -> None:
        self.window_s = window_s
        self._periods: deque[tuple[float, float]] = deque()

    def roll(self, now: float, period_max: float) -> float:
        """Add the maximum of the period ending `now`; returns the window's maximum."""
        self._periods.append((now, period_max))
        while self._periods[0][0] <= now - self.window_s:
            self._periods.popleft()
        return max(value for _, value in self._periods)
