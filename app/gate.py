"""The asyncio side of admission: aiolimiter's token bucket in front of `Admission`'s caps.

A request pays one bucket token per model token it carries (a long input costs what it
computes, not one unit), once its deadline has let it through (`Admission.admit`), so a
request refused for it takes nothing from the bucket. When the
bucket is short it waits, at most `max_wait_s` and never past its deadline, then is turned
away with reason `rate`. The bucket meters what the front end passes on to the engine,
whatever the engine then answers. (The in-flight cap is decided earlier, from the headers:
`Service.shed`.) Every rejection is counted here, where the decision is made. Front-end
event loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiolimiter import AsyncLimiter

from app.admission import Admission, Rejected
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

    async def admit(self, model: str, n_tokens: int, deadline: float) -> None:
        """Pass the deadline, then take `n_tokens` bucket tokens, waiting for
        them within the deadline and `max_wait_s`; raises `Rejected` (already counted)."""
        started = self._clock()
        try:  # before taking tokens a refused request would waste
            self.admission.admit(deadline, started)
        except Rejected as refused:
            raise self.reject(refused, model) from None
        if self._limiter.has_capacity(n_tokens):
            await self._limiter.acquire(n_tokens)
        else:
            budget = max(0.0, min(self._max_wait_s, deadline - started))
            try:
                await asyncio.wait_for(self._limiter.acquire(n_tokens), budget)
            except TimeoutError:
                rejection = self.admission.rate_limited(n_tokens, self.rate_per_s)
                raise self.reject(rejection, model) from None
        self._metrics.admission_wait.labels(model).observe(self._clock() - started)
