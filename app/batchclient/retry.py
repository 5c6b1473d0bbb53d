"""What to do with each answer: keep it, retry it (after how long), or give up on it.

Pure: no I/O; randomness comes from the caller's ``random.Random`` so tests seed it.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class Verdict(enum.Enum):
    SUCCESS = "success"
    RETRY = "retry"  # after Retry-After (with jitter) when given, else exponential backoff
    FAIL = "fail"  # the request itself is wrong: retrying it cannot help
    # The server refuses the client itself (its credentials): every request would get the
    # same answer, so the run stops and its lines stay unfinished, to be redone once the
    # credentials are fixed, instead of the whole input landing in the errors file.
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Outcome:
    verdict: Verdict
    congestion: bool  # counts as "the server is overloaded" for the AIMD controller


# 401 Unauthorized, 407 Proxy Authentication Required: answers about the client's
# credentials (a missing or expired token), not about any one line. Not 403: a gateway may
# forbid one model a line names, and stopping there would stop every rerun at that line.
CLIENT_REFUSED_STATUSES = frozenset({401, 407})


def classify_status(status: int) -> Outcome:
    """2xx keep; 429 and 503 retry (429 also cuts concurrency); 504 is the server's deadline,
    i.e. a queue too long: retry and cut; other 5xx and 408 (the server gave up reading the
    body) retry; 401 and 407 stop the run; other 4xx fail at once."""
    if 200 <= status < 300:
        return Outcome(Verdict.SUCCESS, congestion=False)
    if status in CLIENT_REFUSED_STATUSES:
        return Outcome(Verdict.REFUSED, congestion=False)
    if status in (429, 504):
        return Outcome(Verdict.RETRY, congestion=True)
    if status >= 500 or status == 408:
        return Outcome(Verdict.RETRY, congestion=False)
    return Outcome(Verdict.FAIL, congestion=False)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``max_retries`` bounds the retries of one request, whatever their cause."""

    max_retries: int = 8
    base_backoff_s: float = 0.1
    max_backoff_s: float = 10.0
    # Retry-After is a floor: a fleet told "1 s" waits 1.0-1.5 s, so it does not come back
    # as one wave.
    retry_after_jitter: float = 0.5
    max_retry_after_s: float = 120.0

    def delay_s(self, attempt: int, retry_after_s: float | None, rng: random.Random) -> float:
        """How long to wait before retry number ``attempt`` (1 = the first retry)."""
        if retry_after_s is not None:
            floor = min(retry_after_s, self.max_retry_after_s)
            return floor * (1.0 + self.retry_after_jitter * rng.random())
        ceiling = min(self.max_backoff_s, self.base_backoff_s * 2.0 ** max(0, attempt - 1))
        # "Equal jitter": at least half the exponential step, so backoff still grows.
        return ceiling * (0.5 + 0.5 * rng.random())
