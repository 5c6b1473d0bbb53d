"""The load generator's engine: open-loop and closed-loop runs on one asyncio loop.

Open loop (the default): every request has a send time fixed in advance by the arrival
schedule. A dispatcher hands each request, at its time, to an idle connection worker; when
every connection is busy the request waits in the client, and its latency still counts from
the scheduled time. A server that stalls therefore cannot slow the arrivals down and hide
its own queueing ("coordinated omission"): the stall shows up in every request scheduled
during it.

Closed loop: N workers each send, wait for the answer and send again, N following the
stages. This is what hey and most benchmarks do; it measures capacity at a concurrency,
and its latencies are those of the requests that could be sent.

Time comes from an injected `Clock` (`loadtest/clocks.py`), so tests can drive the schedule
in virtual time; the connections come from an injected factory, so tests can replace the
network. What a run is given and what it records are in `loadtest/records.py`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from loadtest.clocks import Clock, MonotonicClock
from loadtest.httpclient import HttpConnection, RequestError, Response, Target
from loadtest.records import Mode, MonitorSample, Recorder, RunConfig, RunResult
from loadtest.stages import arrival_times, target_at
from loadtest.stats import percentile_of_sorted

logger = logging.getLogger(__name__)

_COUNTERS = ("due", "sent", "completed", "ok", "rejected_429", "errors")

# How often closed-loop stages re-evaluate the number of workers.
_CLOSED_LOOP_TICK_S = 0.05


class Connection(Protocol):
    @property
    def usable(self) -> bool: ...

    async def request(self, payload: bytes, timeout_s: float) -> Response: ...

    def close(self) -> None: ...


ConnectionFactory = Callable[[], Awaitable[Connection]]


def http_connection_factory(target: Target, connect_timeout_s: float) -> ConnectionFactory:
    async def connect() -> Connection:
        return await HttpConnection.open(target, connect_timeout_s)

    return connect


class _Pending:
    """A request between its scheduled time and its final outcome."""

    __slots__ = ("first_sent", "payload", "retries", "scheduled")

    def __init__(self, scheduled: float, payload: bytes) -> None:
        self.scheduled = scheduled
        self.payload = payload
        self.first_sent = -1.0
        self.retries = 0


ProgressCallback = Callable[[MonitorSample, "LoadRun"], None]


class LoadRun:
    """One run; create it, then ``await run()`` once. Call from the event loop thread only."""

    def __init__(
        self,
        config: RunConfig,
        payloads: Sequence[bytes],
        connect: ConnectionFactory,
        clock: Clock | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        if not payloads:
            raise ValueError("no request payloads")
        self.config = config
        self._payloads = payloads
        self._next_payload = 0
        self._connect = connect
        self.clock: Clock = clock or MonotonicClock()
        self._on_progress = on_progress
        self.recorder = Recorder()
        self._outstanding: set[_Pending] = set()
        self._ready: deque[_Pending] = deque()
        self._idle_workers: list[asyncio.Future[_Pending]] = []
        self._in_flight = 0
        self._due = 0
        self._sent = 0
        self._dispatch_lags: array[float] = array("d")
        self._interval_dispatch_lag = 0.0
        self._interval_latencies: list[float] = []
        self._started_at = 0.0
        self._stopping = False
        self._closed_limit = 0
        self._closed_end_at = 0.0
        self._closed_workers: dict[int, asyncio.Task[None]] = {}
        self._retry_timers: list[asyncio.TimerHandle] = []
        # Monitor state: counters now and at the previous sample.
        self._counted = 0
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._counts_at_last_sample = dict(self._counts)
        self._last_sample_at = 0.0
        self._last_cpu = 0.0

    # -- public -----------------------------------------------------------------------------
    async def run(self) -> RunResult:
        self._started_at = self._last_sample_at = self.clock.now()
        self._last_cpu = time.process_time()
        timeline: list[MonitorSample] = []
        monitor = asyncio.create_task(self._monitor(timeline))
        try:
            if self.config.mode is Mode.OPEN:
                await self._run_open()
            else:
                await self._run_closed()
        finally:
            monitor.cancel()
            for timer in self._retry_timers:
                timer.cancel()
        self._take_sample(timeline)  # the last, partial interval
        finished_at = self.clock.now()
        return RunResult(
            config=self.config,
            recorder=self.recorder,
            started_at=self._started_at,
            finished_at=finished_at,
            scheduled_total=self._due,
            dispatch_lags=self._dispatch_lags,
            timeline=timeline,
        )

    @property
    def elapsed_s(self) -> float:
        return self.clock.now() - self._started_at

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def backlog(self) -> int:
        return len(self._ready)

    # -- shared -----------------------------------------------------------------------------
    def _take_payload(self) -> bytes:
        payload = self._payloads[self._next_payload]
        self._next_payload = (self._next_payload + 1) % len(self._payloads)
        return payload

    def _finish(self, item: _Pending, status: int, error: str) -> None:
        done = self.clock.now()
        self._outstanding.discard(item)
        sent = item.first_sent if item.first_sent >= 0 else done
        # Latency starts at the schedule, or at the send if a timer fired early (uvloop's
        # millisecond clock can wake up to a millisecond before the deadline): late sends
        # count their lateness, early ones never make a response look faster than it was.
        start = min(item.scheduled, sent)
        self.recorder.record(start, sent, done, status, error, item.retries)
        if item.retries:
            self.recorder.retried_requests += 1
        if 200 <= status < 300:
            self._interval_latencies.append(done - start)

    async def _attempt(
        self, item: _Pending, connection: Connection | None
    ) -> tuple[Connection | None, Response | None]:
        """One try of ``item``; on a transport error the item is finished as that error and
        the connection dropped (the caller reconnects for its next request)."""
        now = self.clock.now()
        if item.first_sent < 0:
            item.first_sent = now
            self._sent += 1
        self._in_flight += 1
        try:
            if connection is None or not connection.usable:
                if connection is not None:
                    connection.close()
                connection = await self._connect()
            response = await connection.request(item.payload, self.config.timeout_s)
        except RequestError as error:
            if connection is not None:
                connection.close()
            self._finish(item, 0, error.kind)
            return None, None
        finally:
            self._in_flight -= 1
        return connection, response

    def _retry_delay(self, item: _Pending, response: Response) -> float | None:
        """Seconds to wait before retrying a 429, or None when it is final."""
        config = self.config
        if response.status != 429 or not config.retry_429 or item.retries >= config.max_retries:
            return None
        hint = response.retry_after_s
        delay = config.default_retry_after_s if hint is None or hint < 0 else hint
        item.retries += 1
        self.recorder.retry_attempts += 1
        return min(delay, config.max_retry_after_s)

    # -- open loop --------------------------------------------------------------------------
    async def _run_open(self) -> None:
        config = self.config
        workers = [asyncio.create_task(self._open_worker()) for _ in range(config.connections)]
        try:
            for offset in arrival_times(config.stages, config.arrival, config.seed):
                due_at = self._started_at + offset
                if due_at > self.clock.now():
                    await self.clock.sleep_until(due_at)
                lag = self.clock.now() - due_at
                self._dispatch_lags.append(lag)
                self._interval_dispatch_lag = max(self._interval_dispatch_lag, lag)
                item = _Pending(due_at, self._take_payload())
                self._due += 1
                self._outstanding.add(item)
                self._submit(item)
            await self._drain(self._started_at + config.duration_s + config.drain_timeout_s)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self._give_up_outstanding()

    def _submit(self, item: _Pending) -> None:
        # The most recently idle worker goes first: its connection is the warmest, and a
        # run that needs few connections keeps using the same few.
        if self._idle_workers:
            self._idle_workers.pop().set_result(item)
        else:
            self._ready.append(item)

    async def _next_item(self) -> _Pending:
        if self._ready:
            return self._ready.popleft()
        waiter: asyncio.Future[_Pending] = asyncio.get_running_loop().create_future()
        self._idle_workers.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter in self._idle_workers:
                self._idle_workers.remove(waiter)
            elif waiter.done() and not waiter.cancelled():
                self._ready.appendleft(waiter.result())  # handed over as we were cancelled
            raise

    async def _open_worker(self) -> None:
        connection: Connection | None = None
        loop = asyncio.get_running_loop()
        try:
            while True:
                item = await self._next_item()
                connection, response = await self._attempt(item, connection)
                if response is None:
                    continue
                delay = self._retry_delay(item, response)
                if delay is None:
                    self._finish(item, response.status, "")
                else:
                    # Retry later without holding this connection idle meanwhile.
                    self._retry_timers.append(loop.call_later(delay, self._submit, item))
        finally:
            if connection is not None:
                connection.close()

    async def _drain(self, give_up_at: float) -> None:
        """Wait (polling on the clock) until every request has its outcome or time is up."""
        while self._outstanding and self.clock.now() < give_up_at:
            await self.clock.sleep_until(min(self.clock.now() + 0.01, give_up_at))

    def _give_up_outstanding(self) -> None:
        for item in list(self._outstanding):
            self._finish(item, 0, "unfinished")
        self._ready.clear()

    # -- closed loop ------------------------------------------------------------------------
    async def _run_closed(self) -> None:
        config = self.config
        end_at = self._closed_end_at = self._started_at + config.duration_s
        try:
            while self.clock.now() < end_at:
                elapsed = self.clock.now() - self._started_at
                # Half up, not Python's half-to-even, so a ramp's steps are evenly placed.
                self._closed_limit = math.floor(target_at(config.stages, elapsed) + 0.5)
                for index in range(self._closed_limit):
                    task = self._closed_workers.get(index)
                    if task is None or task.done():
                        self._closed_workers[index] = asyncio.create_task(
                            self._closed_worker(index)
                        )
                await self.clock.sleep_until(min(self.clock.now() + _CLOSED_LOOP_TICK_S, end_at))
            self._stopping = True
            await self._drain(end_at + config.drain_timeout_s)
        finally:
            self._stopping = True
            workers = list(self._closed_workers.values())
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self._give_up_outstanding()

    async def _closed_worker(self, index: int) -> None:
        connection: Connection | None = None
        try:
            while (
                not self._stopping
                and index < self._closed_limit
                and self.clock.now() < self._closed_end_at
            ):
                now = self.clock.now()
                item = _Pending(now, self._take_payload())
                self._due += 1
                self._outstanding.add(item)
                while True:
                    connection, response = await self._attempt(item, connection)
                    if response is None:
                        break
                    delay = self._retry_delay(item, response)
                    if delay is None:
                        self._finish(item, response.status, "")
                        break
                    await self.clock.sleep_until(self.clock.now() + delay)
        finally:
            if connection is not None:
                connection.close()

    # -- monitoring -------------------------------------------------------------------------
    async def _monitor(self, timeline: list[MonitorSample]) -> None:
        """Every interval: CPU use of this process, progress counters, the callback."""
        while True:
            await self.clock.sleep_until(self._last_sample_at + self.config.monitor_interval_s)
            self._take_sample(timeline)

    def _take_sample(self, timeline: list[MonitorSample]) -> None:
        now = self.clock.now()
        wall = now - self._last_sample_at
        if wall <= 0:
            return
        cpu = time.process_time()
        counts = self._counts
        statuses = self.recorder.status
        for position in range(self._counted, len(statuses)):
            status = statuses[position]
            if 200 <= status < 300:
                counts["ok"] += 1
            else:
                counts["errors"] += 1
                if status == 429:
                    counts["rejected_429"] += 1
        self._counted = len(statuses)
        counts["completed"] = self._counted
        counts["due"] = self._due
        counts["sent"] = self._sent
        previous = self._counts_at_last_sample
        latencies = self._interval_latencies
        self._interval_latencies = []
        latencies.sort()
        sample = MonitorSample(
            elapsed_s=now - self._started_at,
            interval_s=wall,
            cpu_fraction=(cpu - self._last_cpu) / wall,
            due=counts["due"] - previous["due"],
            sent=counts["sent"] - previous["sent"],
            completed=counts["completed"] - previous["completed"],
            ok=counts["ok"] - previous["ok"],
            rejected_429=counts["rejected_429"] - previous["rejected_429"],
            errors=counts["errors"] - previous["errors"],
            backlog=len(self._ready),
            in_flight=self._in_flight,
            dispatch_lag_max_s=self._interval_dispatch_lag,
            latency_p99_s=percentile_of_sorted(latencies, 99.0) if latencies else None,
        )
        timeline.append(sample)
        self._interval_dispatch_lag = 0.0
        self._last_sample_at, self._last_cpu = now, cpu
        self._counts_at_last_sample = dict(counts)
        if self._on_progress is not None:
            try:
                self._on_progress(sample, self)
            except Exception:  # a broken progress printer must not end the run
                logger.exception("progress callback failed")
