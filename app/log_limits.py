"""Log lines that would otherwise repeat: a verdict logged once per change (`VerdictLog`),
and a line at most once per interval (`Throttle`).

Liveness, readiness and the engine's batch health were computed into probe bodies only: a
pod turned unhealthy (a crash loop, an engine killed and still running, batches failing, a
lost device) and back without a line in any log. Each place that computes one of them
notes it in a `VerdictLog` of its own, which logs when it changed: a probe every few
seconds, or a batch every few milliseconds, adds nothing while it says the same. Pure but
for the logger; one thread (the event loop's of the process that holds it).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

# Counts and durations in a verdict's words ("5 consecutive batches failed", "still runs
# 12 s after it was killed") change while the verdict stays the same: not a change.
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _key(verdict: str, problem: str | None) -> tuple[str, str | None]:
    return verdict, None if problem is None else _NUMBER.sub("#", problem)


class VerdictLog:
    """Logs `subject: verdict (problem)` when the verdict or its problem, numbers aside,
    differs from the last one noted: WARNING with a problem, INFO without. `assumed`: the
    verdict taken as said before the first note (it is not logged then)."""

    def __init__(self, logger: logging.Logger, subject: str, assumed: str | None = None) -> None:
        self._log = logger
        self._subject = subject
        self._last = None if assumed is None else _key(assumed, None)

    def note(self, verdict: str, problem: str | None = None) -> None:
        key = _key(verdict, problem)
        if key == self._last:
            return
        self._last = key
        if problem is None:
            self._log.info("%s: %s", self._subject, verdict)
        else:
            self._log.warning("%s: %s (%s)", self._subject, verdict, problem)


class Throttle:
    """At most one line per `interval_s`: `allow()` says whether one may be logged now,
    counting those held back meanwhile (`held`, read with the next one allowed)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._next = float("-inf")
        self.held = 0  # lines held back since the last one allowed

    def allow(self) -> bool:
        now = self._clock()
        if now < self._next:
            self.held += 1
            return False
        self._next = now + self._interval_s
        return True

    def take_held(self) -> int:
        """The lines held back since the last one allowed; counted afresh from now."""
        held, self.held = self.held, 0
        return held
