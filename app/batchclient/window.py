"""An async concurrency window whose size an ``AimdController`` changes while it is used."""

from __future__ import annotations

import asyncio
import collections

from app.batchclient.pacing import AimdController


class Window:
    """At most ``controller.limit`` holders at once; waiters are served first come, first
    served. A cut limit takes effect as holders leave (nothing in flight is interrupted).
    The event loop's thread only."""

    def __init__(self, controller: AimdController) -> None:
        self.controller = controller
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        if not self._waiters and self.in_flight < self.controller.limit:
            self.in_flight += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over just as the caller gave up
            elif waiter in self._waiters:
                # Not there when a `wake` between the cancellation and this handler
                # already dropped it as done.
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.in_flight -= 1
        self.wake()

    def wake(self) -> None:
        """Hand free slots to waiters; call after the limit grew."""
        while self._waiters and self.in_flight < self.controller.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)
