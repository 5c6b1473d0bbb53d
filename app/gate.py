"""The asyncio side of admission: aiolimiter's token bucket in front of `Admission`'s caps.

A request pays one bucket token per model token it carries (a long input costs what it
computes, not one unit). When the bucket is short it waits, at most `max_wait_s` and never
past its deadline, then is turned away with reason `rate`. Then the in-flight cap decides
(`admission.py`). Every rejection is counted here, where the decision is made. Front-end
event loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiolimiter import AsyncLimiter

from app.admission import Admission, Rejected, Ticket
from app.metrics import Metrics


class AdmissionGate:
    def __init__(
        self,
        admission: Admission,
        rate_per_s: float,
        burst: int,
        max_wait_s: float,
        metrics: Metrics,
        clock: Callable[[], float],
    ) -> None:
        self.admission = admission
        self.rate_per_s = rate_per_s
        self._max_wait_s = max_wait_s
        self._metrics = metrics
        self._clock = clock
        # aiolimiter's bucket holds `max_rate` tokens and refills them over `time_period`.
        self._limiter = AsyncLimiter(max_rate=burst, time_period=burst / rate_per_s)

    def reject(self, rejection: Rejected, model: str) -> Rejected:
        """Count a rejection decided here or by the caller, and hand it back to raise."""
        self._metrics.rejected.labels(model, rejection.reason.value).inc()
        return rejection

    def has_capacity(self, n_tokens: int) -> bool:
        """Whether `n_tokens` could be taken now without waiting."""
        return bool(self._limiter.has_capacity(n_tokens))

    async def admit(self, model: str, n_tokens: int, deadline: float) -> Ticket:
        """Wait for `n_tokens` bucket tokens, then pass the in-flight cap; raises
        `Rejected` (already counted)."""
        started = self._clock()
        if self.admission.draining:  # before waiting for tokens it will not need
            raise self.reject(self.admission.draining_rejection(), model)
        if self._limiter.has_capacity(n_tokens):
            await self._limiter.acquire(n_tokens)
        else:
            budget = max(0.0, min(self._max_wait_s, deadline - started))
            try:
                await asyncio.wait_for(self._limiter.acquire(n_tokens), budget)
            except TimeoutError:
                rejection = self.admission.rate_limited(n_tokens, self.rate_per_s)
                raise self.reject(rejection, model) from None
        try:
            ticket = self.admission.admit(deadline, self._clock())
        except Rejected as rejection:
            raise self.reject(rejection, model) from None
        self._metrics.admission_wait.labels(model).observe(self._clock() - started)
        return ticket
