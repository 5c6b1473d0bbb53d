"""Draining a front end on shutdown: stop admitting, then wait until every admitted
request is answered and clients have stopped arriving (docs/ARCHITECTURE.md §3).

`Drain` is created and called on its front end's event loop thread; `Service` tells it of
each arrival and each answered request.
"""

from __future__ import annotations

import asyncio
import logging

from app.admission import Admission

log = logging.getLogger(__name__)

# After a server's drain timeout: the time its stop may still take, for the front ends' own
# shutdown and the engine's (ENGINE_STOP_S of it kept for the engine's); hung ones are
# killed then (app/processes.py). A pod's grace period must exceed preStop + drain + this
# (check-config checks it), or the kubelet's SIGKILL cuts the stop short. The front ends get
# the drain + 8 s: after a drain that timed out, their own graceful shutdown takes up to
# FRONTEND_GRACEFUL_SHUTDOWN_S (uvicorn's timeout_graceful_shutdown) and their lifespan's end.
STOP_MARGIN_S = 12.0
ENGINE_STOP_S = 4.0
FRONTEND_GRACEFUL_SHUTDOWN_S = 5


class Drain:
    """Its timeout is measured on the event loop's clock, the one it waits on, not the
    service's injectable one: it is real time (what the pod's grace period is sized for),
    and a clock a test holds still would never let it pass."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._idle = asyncio.Event()
        self._arrival = asyncio.Event()

    def arrived(self) -> None:
        """A request arrived (admitted or not): the quiet period starts again."""
        self._arrival.set()

    def left(self) -> None:
        """An admitted request was answered (after `Admission.leave`)."""
        if self._admission.draining and self._admission.inflight == 0:
            self._idle.set()

    def begin(self) -> None:
        """Stop admitting (503) and report unready; admitted requests carry on."""
        if not self._admission.draining:
            log.info("draining: %d requests in flight", self._admission.inflight)
        self._admission.draining = True
        if self._admission.inflight == 0:
            self._idle.set()

    async def wait(self, timeout_s: float, quiet_s: float) -> bool:
        """True when every admitted request was answered and no new one arrived for
        `quiet_s`, all within `timeout_s`."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + timeout_s
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            # Nothing new is admitted while draining, but clients may still be arriving to
            # hear 503: wait until none has for `quiet_s`, within the drain timeout.
            while (remaining := give_up_at - loop.time()) > 0:
                self._arrival.clear()
                try:
                    await asyncio.wait_for(self._arrival.wait(), min(quiet_s, remaining))
                except TimeoutError:
                    break
        except TimeoutError:
            pass
        if self._admission.inflight:
            log.warning("drain timeout: %d requests still in flight", self._admission.inflight)
            return False
        log.info("drained")
        return True
