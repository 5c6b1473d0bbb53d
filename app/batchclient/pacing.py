"""How many requests a batch client keeps in flight: AIMD, as TCP's congestion window.

Pure: no I/O, no clock. The caller (one event loop) reports each request it sends and how
it ended; the controller answers with the current limit.

- Slow start: from ``initial`` the limit grows by one per success (doubling every round
  trip) until the first congestion signal.
- Congestion avoidance: then it grows by one per ``limit`` successes (one per round trip).
- Multiplicative decrease: a congestion signal (429, a server-side deadline, a client
  timeout) multiplies the limit by ``decrease_factor``, at most once per window: a signal
  from a request sent before the last decrease is about a window already cut and is
  ignored, so one overload answered by 500 x 429 halves the limit once, not 500 times.
- Growth only when the window is used: a success that arrives while fewer than ``limit``
  requests were in flight says nothing about a larger window (RFC 7661's cwnd validation),
  so a client held back by ``--rate`` or by retries does not inflate its limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PacingSnapshot:
    limit: int
    lowest_limit: int
    highest_limit: int
    decreases: int


class AimdController:
    """Adaptive concurrency limit between ``min_limit`` and ``max_limit``; one loop only."""

    def __init__(
        self,
        max_limit: int,
        *,
        min_limit: int = 1,
        initial: int = 8,
        decrease_factor: float = 0.5,
        adaptive: bool = True,
    ) -> None:
        if not 1 <= min_limit <= max_limit:
            raise ValueError(f"need 1 <= min_limit ({min_limit}) <= max_limit ({max_limit})")
        if not 0.0 < decrease_factor < 1.0:
            raise ValueError(f"decrease_factor {decrease_factor} is not in (0, 1)")
        self.max_limit = max_limit
        self.min_limit = min_limit
        self.decrease_factor = decrease_factor
        self.adaptive = adaptive
        start = max_limit if not adaptive else min(max(initial, min_limit), max_limit)
        self._limit = start
        self._slow_start = adaptive
        self._successes_since_growth = 0
        self._epoch = 0
        self._lowest = start
        self._highest = start
        self._decreases = 0

    @property
    def limit(self) -> int:
        return self._limit

    def on_send(self) -> int:
        """Call as a request is sent; the ticket goes back with its outcome."""
        return self._epoch

    def on_success(self, ticket: int, in_flight: int) -> None:
        """A 2xx arrived; ``in_flight`` counts requests outstanding just before it arrived."""
        del ticket  # successes are never stale: any success is evidence of capacity
        if not self.adaptive or self._limit >= self.max_limit or in_flight < self._limit:
            return
        if self._slow_start:
            self._set(self._limit + 1)
            return
        self._successes_since_growth += 1
        if self._successes_since_growth >= self._limit:
            self._successes_since_growth = 0
            self._set(self._limit + 1)

    def on_congestion(self, ticket: int) -> bool:
        """The server said it is overloaded; returns whether the limit was cut."""
        if not self.adaptive or ticket < self._epoch:
            return False
        self._epoch += 1
        self._slow_start = False
        self._successes_since_growth = 0
        self._decreases += 1
        self._set(max(self.min_limit, math.floor(self._limit * self.decrease_factor)))
        return True

    def snapshot(self) -> PacingSnapshot:
        return PacingSnapshot(self._limit, self._lowest, self._highest, self._decreases)

    def _set(self, limit: int) -> None:
        self._limit = min(max(limit, self.min_limit), self.max_limit)
        self._lowest = min(self._lowest, self._limit)
        self._highest = max(self._highest, self._limit)
