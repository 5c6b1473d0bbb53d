"""A rate of events (places freed per second) measured as an exponentially decayed average,
with an injected clock: `now` is passed in. Pure; one owner's thread.
"""

from __future__ import annotations

import math

# A rate last measured longer ago than this many time constants (decayed to under 5%)
# says nothing about now: a minute after a busy spell it predicted a wait of ~1,600 s.
STALE_AFTER_TAUS = 3.0


class RateMeter:
    """Events per second, exponentially decayed with time constant `tau_s`.

    A continuous-time EWMA: each event adds 1/tau to the rate, which decays by exp(-dt/tau).
    """

    def __init__(self, tau_s: float = 5.0) -> None:
        self._tau = tau_s
        self._rate = 0.0
        self._last: float | None = None

    def record(self, count: int, now: float) -> None:
        self._rate = self.rate(now) + count / self._tau
        self._last = now

    def rate(self, now: float) -> float:
        if self._last is None:
            return 0.0
        return self._rate * math.exp(-max(0.0, now - self._last) / self._tau)

    def measured(self, now: float) -> float | None:
        """The rate, or None while it is unknown: no event yet, or none for
        `STALE_AFTER_TAUS` time constants (a quiet spell, not a slow rate)."""
        if self._last is None or now - self._last > STALE_AFTER_TAUS * self._tau:
            return None
        return self.rate(now)
