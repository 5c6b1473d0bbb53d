"""`SlowRequestMiddleware`: times each inference request from its arrival at the app to the
last byte of its answer, and hands a slow one to the recorder with its phases, the engine's
trace and the front end's probe changes over its lifetime (docs/SPIKES.md).

It sits inside `ServerTimingMiddleware` (whose `PhaseTimer` the routes and the service fill
in) and outside the routes; requests shed before the body are answered further out and are
never slow. A request whose route raised an error no handler answers (a fault of the
server's own, a bug: `ServerTimingMiddleware` answers it 500) is timed until the error and
judged with status 500; a failed batch's 500 is answered by its handler, timed as any
answer. Front-end event loop thread only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.spikes.attribution import RequestFacts
from app.spikes.recorder import SlowRequestRecorder
from app.telemetry.probe import changes
from app.telemetry.sampler import ProcessTelemetry
from app.timing import PhaseTimer


class SlowRequestMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        recorder: SlowRequestRecorder,
        telemetry: ProcessTelemetry,
        is_inference: Callable[[str], bool],
        batching_window_s: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`is_inference(path)`: whether requests to `path` are timed and reported."""
        self.app = app
        self.recorder = recorder
        self.telemetry = telemetry
        self.is_inference = is_inference
        self.batching_window_s = batching_window_s
        self.pid = os.getpid()
        self._clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.is_inference(scope["path"]):
            await self.app(scope, receive, send)
            return
        started = self._clock()
        # Where the probes stood as the request began (as of the last tick: the one before
        # a slow request's 150 ms is close enough); read afresh only if it turns out slow.
        readings = self.telemetry.snapshot()
        status = 0
        finished: float | None = None

        async def timed_send(message: Message) -> None:
            nonlocal status, finished
            await send(message)
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = self._clock()

        failed: float | None = None
        try:
            await self.app(scope, receive, timed_send)
        except Exception:
            # No handler answered it (a fault of the server's own, a bug):
            # `ServerTimingMiddleware`, further out, answers 500. Judged here all the same,
            # or the slow requests that end worst would be the ones never reported.
            if finished is None:
                failed = self._clock()
            raise
        finally:
            if finished is not None:
                self._finished(scope, status, finished - started, readings)
            elif failed is not None:
                self._finished(scope, 500, failed - started, readings)

    def _finished(
        self, scope: Scope, status: int, total_s: float, readings: dict[str, float]
    ) -> None:
        timer: PhaseTimer | None = scope.get("state", {}).get("server_timing")
        if timer is not None and not timer.latency_bound:
            return
        threshold_s = self.recorder.slow_threshold(total_s)
        if threshold_s is None:
            return
        facts = RequestFacts(
            total_s=total_s,
            phases=dict(timer.phases) if timer else {},
            frontend_pid=self.pid,
            frontend_probes=changes(readings, self.telemetry.read()),
            engine=timer.engine_trace if timer else None,
            batching_window_s=self.batching_window_s,
            off_loop=frozenset(timer.off_loop) if timer else frozenset(),
        )
        self.recorder.record(scope["method"], scope["path"], status, facts, threshold_s)
