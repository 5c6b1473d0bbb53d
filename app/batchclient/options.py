"""How a ``BatchClient`` sends: concurrency, pacing, rate, packing, timeouts, retries."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from app.batchclient.retry import RetryPolicy


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How a ``BatchClient`` sends. ``concurrency`` is the most requests in flight; with
    ``adaptive`` the client moves between 1 and it (AIMD), else it stays at it.
    ``rate`` caps requests per second, retries included."""

    concurrency: int = 128
    adaptive: bool = True
    rate: float | None = None
    inputs_per_request: int = 1
    timeout_s: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    headers: Mapping[str, str] = field(default_factory=dict)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.rate is not None and not (0 < self.rate < math.inf):
            raise ValueError("rate must be positive and finite")
        if self.inputs_per_request < 1:
            raise ValueError("inputs_per_request must be at least 1")
        if not (0 < self.timeout_s < math.inf):
            raise ValueError("timeout must be positive and finite")
