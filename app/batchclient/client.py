"""The batch client: items in, one result per item out, at the pace the server can take.

``BatchClient.infer_many`` sends each request when the AIMD window (``pacing``) and the
optional rate limit (aiolimiter) allow, retries what ``retry`` says to retry, and yields a
``Success`` or ``Failure`` for every item exactly once (or nothing for items left
unfinished by ``stop``). Memory is bounded: at most ``2 x concurrency`` requests are read
ahead of their answers. One event loop; ``stop`` and ``abort`` from that loop's thread.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Iterable,
    Mapping,
)
from types import TracebackType
from typing import Any

from aiolimiter import AsyncLimiter

from app.batchclient.attempt import Attempt, error_of, error_type_of, failures_of, results_of
from app.batchclient.items import Failure, Item, Packer, Request, Result
from app.batchclient.options import ClientOptions
from app.batchclient.pacing import AimdController
from app.batchclient.retry import (
    DEADLINE_STATUS,
    ENGINE_LOST_ERROR,
    Verdict,
    classify_answer,
    classify_status,
    give_up_reason,
)
from app.batchclient.stats import BatchStats, Counters
from app.batchclient.transport import ConnectionPool, RequestError
from app.batchclient.window import Window


class ClientRefused(Exception):
    """The server refused the client itself (401 or 407): raised by ``infer_many``
    after what was answered before has been yielded. The items not answered are neither
    yielded nor failed: they stay unfinished, to be sent again with other credentials."""

    def __init__(self, status: int, error: Mapping[str, Any]) -> None:
        message = error.get("message") or error.get("type") or "no reason given"
        super().__init__(f"the server refused this client: HTTP {status}: {message}")
        self.status = status
        self.error = error


class BatchClient:
    """Async client for ``POST {url}/infer``; use as ``async with BatchClient(url) as c``."""

    @staticmethod
    def infer_url_for(url: str) -> str:
        """The /infer URL of a server or Envoy base URL."""
        return url.rstrip("/") + "/infer"

    def __init__(self, url: str, options: ClientOptions | None = None) -> None:
        self.options = options or ClientOptions()
        self.infer_url = self.infer_url_for(url)
        self._http: ConnectionPool | None = None
        self.controller = AimdController(self.options.concurrency, adaptive=self.options.adaptive)
        self._window = Window(self.controller)
        # Capacity 1 and one token per 1/rate s: requests are spaced, never bunched, so in
        # any second there are at most rate + 1 of them.
        self._limiter = (
            AsyncLimiter(1, 1.0 / self.options.rate) if self.options.rate is not None else None
        )
        self._rng = random.Random(self.options.seed)
        self._counters = Counters()
        self._max_active = 2 * self.options.concurrency
        self._stopping = False
        self._waiting: set[asyncio.Task[Any]] = set()  # cancellable: nothing sent yet
        self._sending: set[asyncio.Task[Any]] = set()
        self._refused: ClientRefused | None = None

    async def __aenter__(self) -> BatchClient:
        self._http = ConnectionPool(self.infer_url, self.options.headers)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    # -- control -------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """Send nothing more: requests in flight are answered and yielded, nothing else."""
        self._stopping = True
        for task in list(self._waiting):
            task.cancel()

    def abort(self) -> None:
        """Stop at once: requests in flight are dropped too (their items stay unfinished);
        what was answered before is still yielded (a split pack's singles included)."""
        self.stop()
        for task in list(self._sending):
            task.cancel()

    def stats(self) -> BatchStats:
        return self._counters.snapshot(self.controller.snapshot(), self._window.in_flight)

    # -- the run -------------------------------------------------------------------------
    async def infer_many(
        self, items: Iterable[Item] | AsyncIterable[Item]
    ) -> AsyncGenerator[Result, None]:
        """Yield one result per item as answers arrive (not in input order).

        Items are read lazily, at most ``2 x concurrency`` requests ahead. After ``stop``
        the items not yet answered are neither sent nor yielded (``lines_unfinished``).
        A 401 or 407 stops the run the same way, then raises ``ClientRefused``.
        """
        if self._http is None:
            raise RuntimeError("use the client as `async with BatchClient(...) as client`")
        results: asyncio.Queue[list[Result] | None] = asyncio.Queue(maxsize=self._max_active)
        # Answers received by tasks that `abort` (or a crash) then ended: yielded last, so
        # that they are written and a rerun does not send them again.
        salvaged: collections.deque[Result] = collections.deque()
        crashes: list[BaseException] = []
        active = asyncio.Semaphore(self._max_active)
        tasks: set[asyncio.Task[None]] = set()

        async def finish(request: Request) -> None:
            received: list[Result] = []  # a split pack's singles answered so far
            try:
                done = await self._complete(request, received)
                if done:
                    await results.put(done)
            except asyncio.CancelledError:
                # Cancelled by stop/abort, which count on this: the items not answered stay
                # unfinished.
                self._counters.lines_unfinished += len(request.items) - len(received)
                salvaged.extend(received)
            except Exception as error:  # a bug, not an answer: the consumer raises it
                self._counters.lines_unfinished += len(request.items) - len(received)
                salvaged.extend(received)
                crashes.append(error)
                self.abort()
            finally:
                active.release()

        async def start(request: Request) -> bool:
            await active.acquire()
            if self._stopping:
                active.release()
                self._counters.lines_unfinished += len(request.items)
                return False
            task = asyncio.create_task(finish(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return True

        async def produce() -> None:
            try:
                packer = Packer(self.options.inputs_per_request)
                async for item in _each(items):
                    if self._stopping:
                        break
                    for request in packer.add(item):
                        await start(request)
                if not self._stopping:
                    for request in packer.flush():
                        await start(request)
            except Exception as error:  # the items' iterator failed: stop, then raise it
                crashes.append(error)
                self.stop()
            while tasks:
                await asyncio.wait(set(tasks))
            await results.put(None)

        producer = asyncio.create_task(produce())
        try:
            while (got := await results.get()) is not None:
                for result in got:
                    yield self._handed_over(result)
            while salvaged:  # every task has ended: nothing is added any more
                yield self._handed_over(salvaged.popleft())
            if crashes:
                raise crashes[0]
            if self._refused is not None:
                raise self._refused
        finally:
            if not producer.done():
                # The consumer left early: nothing more can be yielded, so every task goes,
                # including those holding an answer for a queue no one reads.
                self.abort()
                producer.cancel()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(producer, *tasks, return_exceptions=True)
            self._counters.lines_unfinished += len(salvaged)  # answered, never handed over

    def _handed_over(self, result: Result) -> Result:
        """Count a result as ``infer_many`` yields it: counted as handed over, not as
        answered, so that one a consumer leaving early never gets is unfinished."""
        if isinstance(result, Failure):
            self._counters.lines_failed += 1
        else:
            self._counters.lines_ok += 1
        return result

    async def _complete(
        self, request: Request, received: list[Result] | None = None
    ) -> list[Result] | None:
        """Send until answered or given up; None when stopped before an answer.
        ``received``: where a pack resent one item at a time collects the items' results as
        they come (its caller's, to hand them over if the task is cancelled)."""
        received = [] if received is None else received
        policy = self.options.retry
        attempt_number = 0
        deadline_answers = 0  # 504s to this request
        engine_lost_answers = 0  # 503 `engine_lost`s to this request
        while True:
            attempt_number += 1
            attempt = await self._attempt(request, deadline_before=deadline_answers > 0)
            if attempt is None:  # stopped before it was sent
                self._counters.lines_unfinished += len(request.items)
                return None
            if attempt.status == DEADLINE_STATUS:
                deadline_answers += 1
            error_type = error_type_of(attempt)
            if error_type == ENGINE_LOST_ERROR:
                engine_lost_answers += 1
            outcome = (
                classify_answer(attempt.status, error_type)
                if attempt.status is not None
                else classify_status(599)  # no response: a transient fault, backoff
            )
            if outcome.verdict is Verdict.REFUSED:
                assert attempt.status is not None
                if self._refused is None:
                    self._refused = ClientRefused(attempt.status, error_of(attempt))
                self.stop()
                self._counters.lines_unfinished += len(request.items)
                return None
            if outcome.verdict is Verdict.SUCCESS:
                results = results_of(request, attempt, attempt_number)
                if results is not None:
                    self._counters.latency.add(attempt.latency_s)
                    return results
                outcome_retry = True
            else:
                outcome_retry = outcome.verdict is Verdict.RETRY
            if not outcome_retry:
                if len(request.items) > 1:
                    return await self._one_by_one(request, received)
                return failures_of(request, attempt, attempt_number, retryable=False)
            out_of_deadline = deadline_answers > policy.max_deadline_retries
            out_of_engines = engine_lost_answers > policy.max_engine_lost_retries
            if attempt_number > policy.max_retries or out_of_deadline or out_of_engines:
                if len(request.items) > 1 and (
                    out_of_engines or attempt.status in (500, DEADLINE_STATUS)
                ):
                    # A 500 to every try may be one item's doing (a NaN from one input), a
                    # 504 one slow input's (the pack computes past its deadline), an
                    # `engine_lost` one input's that kills the engine: the others would
                    # succeed alone.
                    return await self._one_by_one(request, received)
                reason = give_up_reason(
                    attempt_number,
                    deadline_answers if out_of_deadline else 0,
                    engine_lost_answers if out_of_engines else 0,
                )
                return failures_of(request, attempt, attempt_number, retryable=True, reason=reason)
            if self._stopping:
                self._counters.lines_unfinished += len(request.items)
                return None
            self._counters.retries += 1
            delay = policy.delay_s(attempt_number, attempt.retry_after_s, self._rng)
            if not await self._wait(asyncio.sleep(delay)):
                self._counters.lines_unfinished += len(request.items)
                return None

    async def _one_by_one(self, request: Request, received: list[Result]) -> list[Result] | None:
        """Which item did the server refuse? Each sent alone, with retries of its own, its
        results added to ``received`` as they come; None when stopped before the first was
        answered (the rest stay unfinished, and the singles answered before are yielded)."""
        singles = request.split()
        for index, single in enumerate(singles):
            answered = await self._complete(single)
            if answered is None:
                self._counters.lines_unfinished += len(singles) - index - 1
                return received or None
            received.extend(answered)
        return received

    async def _wait(self, awaitable: Any) -> bool:
        """Await something before a request is sent; False when ``stop`` ended the wait
        (nothing is sent then, and what this task already holds is still yielded)."""
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            await awaitable
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            task.uncancel()  # stop's cancellation, handled here
            return False
        finally:
            self._waiting.discard(task)
        return True

    async def _attempt(self, request: Request, *, deadline_before: bool) -> Attempt | None:
        """One POST once the window and the rate limit allow it; None when stopped before
        it was sent. ``deadline_before``: this request was answered 504 already."""
        if not await self._wait(self._window.acquire()):
            return None
        try:
            if self._limiter is not None and not await self._wait(self._limiter.acquire()):
                return None
            if self._stopping:
                return None  # stopped while waiting for a token
            task = asyncio.current_task()
            assert task is not None
            self._sending.add(task)
            try:
                attempt = await self._post(request)
            finally:
                self._sending.discard(task)
            # Those actually sent, this one included; not those holding a window slot while
            # they wait for a rate token, which say nothing about the server's capacity.
            self._pace(attempt, len(self._sending) + 1, deadline_before=deadline_before)
        finally:
            self._window.release()
        return attempt

    async def _post(self, request: Request) -> Attempt:
        assert self._http is not None
        self._counters.requests += 1
        ticket = self.controller.on_send()
        started = time.perf_counter()
        try:
            response = await self._http.post(request.body, self.options.timeout_s)
        except RequestError as error:
            kind = "timeout" if error.kind == RequestError.TIMEOUT else error.kind
            if kind == "timeout":
                self._counters.timeouts += 1
            else:
                self._counters.resets += 1
            return Attempt(None, b"", None, time.perf_counter() - started, ticket, kind)
        latency = time.perf_counter() - started
        self._counters.statuses[response.status] += 1
        return Attempt(response.status, response.body, response.retry_after_s, latency, ticket)

    def _pace(self, attempt: Attempt, in_flight: int, *, deadline_before: bool) -> None:
        """Tell the AIMD controller how the attempt went; a grown limit wakes waiters.

        A 504 to a request answered 504 before is not congestion: the request does not fit
        its deadline, and each retry halving the window again took one such line's retries
        down to a concurrency of 1 for every other line."""
        if attempt.status is not None and 200 <= attempt.status < 300:
            self.controller.on_success(attempt.ticket, in_flight)
            self._window.wake()
        elif attempt.status == DEADLINE_STATUS and deadline_before:
            return
        elif attempt.transport == "timeout" or (
            attempt.status is not None and classify_status(attempt.status).congestion
        ):
            self.controller.on_congestion(attempt.ticket)


async def _each(items: Iterable[Item] | AsyncIterable[Item]) -> AsyncIterator[Item]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
