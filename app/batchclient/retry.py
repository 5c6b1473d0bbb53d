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


# The server's "this request's deadline cannot be met". steadyserve answers a queue over
# its delay budget with 429; its 504 says the wait the request's own deadline allows, or its
# own compute, does not fit that deadline. Once it is congestion (the queue may shorten);
# again for the same request it is about the request, and retrying cannot help for long.
DEADLINE_STATUS = 504


def classify_status(status: int) -> Outcome:
    """2xx keep; 429 and 503 retry (429 also cuts concurrency); 504 (the request's deadline
    cannot be met) retry and cut, a few times only (``RetryPolicy.max_deadline_retries``);
    other 5xx and 408 (the server gave up reading the body) retry; 401 and 407 stop the
    run; other 4xx fail at once."""
    if 200 <= status < 300:
        return Outcome(Verdict.SUCCESS, congestion=False)
    if status in CLIENT_REFUSED_STATUSES:
        return Outcome(Verdict.REFUSED, congestion=False)
    if status in (429, DEADLINE_STATUS):
        return Outcome(Verdict.RETRY, congestion=True)
    if status >= 500 or status == 408:
        return Outcome(Verdict.RETRY, congestion=False)
    return Outcome(Verdict.FAIL, congestion=False)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``max_retries`` bounds the retries of one request, whatever their cause; of those,
    at most ``max_deadline_retries`` follow a 504 (a request answered 504 that many times
    plus one fails: it does not fit its deadline, and other lines go on without it), and at
    most ``max_engine_lost_retries`` an ``ENGINE_LOST_ERROR`` (a request answered it that
    many times plus one fails: it may be what kills the engine)."""

    max_retries: int = 8
    max_deadline_retries: int = 2
    max_engine_lost_retries: int = 2
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


# Errors a server answers for a request that must not be resent unchanged, whatever its
# status: steadyserve's 500 `device_lost` (the request's batch failed with a sticky CUDA error
# and its engine restarts: an input of that batch may be the cause, and each resend of it
# would take a fresh engine down again). A line answered one fails (in the errors file, not
# retryable); a pack answered one is resent one line per request, so each of its lines is
# sent once more, alone: the line at fault fails, the others are answered.
NOT_RESENT_ERRORS = frozenset({"device_lost"})

# steadyserve's 503 `engine_lost`: the engine process exited (a segfault, an abort, an OOM
# kill) with the request in it. Resent, as most requests an engine exits with are innocent,
# but a few times only (``RetryPolicy.max_engine_lost_retries``): one that was in it each time
# may be what kills it, and each resend would take a fresh engine, and every other request
# in it, down again (the server leaves `x-steadyserve-retry-elsewhere` off it for that
# reason). A pack answered it that often is resent one line per request; a line, fails.
ENGINE_LOST_ERROR = "engine_lost"


def classify_answer(status: int, error_type: str | None) -> Outcome:
    """``classify_status``, but an error of ``NOT_RESENT_ERRORS`` (``error_type``: the
    answer's ``error.code``, else its ``error.type``) fails at once."""
    if error_type in NOT_RESENT_ERRORS and not 200 <= status < 300:
        return Outcome(Verdict.FAIL, congestion=False)
    return classify_status(status)


def give_up_reason(attempts: int, deadline_answers: int, engine_lost_answers: int) -> str:
    """Why a request resent ``attempts`` times fails; ``deadline_answers`` and
    ``engine_lost_answers``: its 504s and `engine_lost`s when their limit ended it, else 0."""
    if deadline_answers:
        return (
            f"answered 504 {deadline_answers} times: the server cannot compute this request "
            "within its deadline (a longer timeout_ms may let it)"
        )
    if engine_lost_answers:
        return (
            f"answered 503 engine_lost {engine_lost_answers} times: the engine exited with "
            "this request in it each time, and it may be what kills it (resend it with "
            "--retry-errors once that is ruled out)"
        )
    return f"out of retries after {attempts} tries"
