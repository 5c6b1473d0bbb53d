"""What a load run is asked to do and what it recorded: `RunConfig` (with `Mode`), the
per-request `Recorder` (error kinds coded by `ERROR_KINDS`), the `MonitorSample` timeline and
the `RunResult`. The runner (`loadtest/runner.py`) fills them on its event loop thread; the
report (`loadtest/report.py`), the hey summary and the benches read them once the run is over.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import Enum

from loadtest.httpclient import RequestError
from loadtest.stages import Arrival, Stage, total_duration

#: Error kinds in the order their codes are stored; code 0 means "an HTTP response came".
ERROR_KINDS: tuple[str, ...] = (
    "",
    RequestError.CONNECT,
    RequestError.CLOSED,
    RequestError.TIMEOUT,
    RequestError.PROTOCOL,
    "unfinished",
)
_ERROR_CODE = {kind: code for code, kind in enumerate(ERROR_KINDS)}


class Mode(Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class RunConfig:
    mode: Mode
    stages: tuple[Stage, ...]
    arrival: Arrival = Arrival.CONSTANT
    #: Open loop: the most connections (requests in flight) it may use.
    connections: int = 256
    timeout_s: float = 30.0
    retry_429: bool = False
    max_retries: int = 3
    #: Used when a 429 carries no usable Retry-After, and as a cap on the ones that do.
    default_retry_after_s: float = 1.0
    max_retry_after_s: float = 10.0
    #: After the last scheduled send: how long outstanding requests may still take.
    drain_timeout_s: float = 30.0
    monitor_interval_s: float = 1.0
    seed: int | None = None

    @property
    def duration_s(self) -> float:
        return total_duration(self.stages)


class Recorder:
    """Per-request outcomes in compact arrays (about 30 bytes a request).

    ``scheduled`` is when the request's latency starts: its scheduled time (open loop;
    the send if that came earlier) or its first send (closed loop); ``sent`` is when its
    first attempt went on the wire, ``done`` when its final answer (or error) came.
    Latency is ``done - scheduled``.
    """

    def __init__(self) -> None:
        self.scheduled = array("d")
        self.sent = array("d")
        self.done = array("d")
        self.status = array("h")
        self.error = array("b")
        self.retries = array("b")
        self.retried_requests = 0
        self.retry_attempts = 0

    def record(
        self, scheduled: float, sent: float, done: float, status: int, error: str, retries: int
    ) -> None:
        self.scheduled.append(scheduled)
        self.sent.append(sent)
        self.done.append(done)
        self.status.append(status)
        self.error.append(_ERROR_CODE[error])
        self.retries.append(min(retries, 127))

    def __len__(self) -> int:
        return len(self.done)


@dataclass(slots=True)
class MonitorSample:
    """One interval of the run as the generator saw it (the JSON report's timeline)."""

    elapsed_s: float
    interval_s: float
    cpu_fraction: float
    due: int
    sent: int
    completed: int
    ok: int
    rejected_429: int
    errors: int
    backlog: int
    in_flight: int
    #: Open loop: worst lateness of the dispatcher itself (client-side lag) in the interval.
    dispatch_lag_max_s: float
    latency_p99_s: float | None


@dataclass(slots=True)
class RunResult:
    config: RunConfig
    recorder: Recorder
    started_at: float
    finished_at: float
    scheduled_total: int
    dispatch_lags: array[float]
    timeline: list[MonitorSample] = field(default_factory=list)
