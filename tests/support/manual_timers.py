"""An event loop whose timers (`call_later`) are due on a clock the test moves: the protocol's
deadlines tested without racing the machine's speed (tests/unit/test_header_limits.py)."""

from __future__ import annotations

import asyncio
from typing import Any

WAIT_S = 10.0  # the most `until_armed` waits: a failure, not a bound on timing


class Timer:
    def __init__(self, delay: float, callback: Any) -> None:
        self.delay, self.callback, self.cancelled = delay, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class ManualTimers:
    """The running event loop, but the timers set through it (`call_later`) are due on a
    clock that moves only when the test calls `advance`, which runs those that fall due,
    in order. Everything else (sockets, tasks) is the real loop's."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.now = 0.0
        self.timers: list[tuple[float, Timer, tuple[Any, ...]]] = []  # due at, timer, args
        self._armed = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Any, *args: Any) -> Timer:
        self.timers.append((self.now + delay, Timer(delay, callback), args))
        self._armed.set()
        return self.timers[-1][1]

    def advance(self, seconds: float) -> list[str]:
        """Move the clock on, running the timers that fall due; the names of their callbacks."""
        self.now += seconds
        ran = []
        while due := [entry for entry in self.timers if entry[0] <= self.now]:
            entry = min(due, key=lambda entry: entry[0])
            self.timers.remove(entry)
            _, timer, args = entry
            if not timer.cancelled:
                ran.append(timer.callback.__name__)
                timer.callback(*args)
        return ran

    async def until_armed(self, callback_name: str) -> None:
        """Wait (on the loop, within `WAIT_S`) until a timer running `callback_name` is pending."""

        async def armed() -> None:
            while not any(
                timer.callback.__name__ == callback_name and not timer.cancelled
                for _, timer, _ in self.timers
            ):
                self._armed.clear()
                await self._armed.wait()

        await asyncio.wait_for(armed(), WAIT_S)
