"""A clock a test moves by hand: inject it where the code takes a `clock` callable."""

from __future__ import annotations


class ManualClock:
    """Reads `now`, which the test sets; it never moves by itself."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
