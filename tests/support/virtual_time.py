"""An event loop whose time is virtual: whenever every task waits, the loop jumps to the
next timer instead of sleeping, so what a test measures on the loop's clock (send times,
waits, latencies) is exact and does not depend on how fast or loaded the machine is.

Only for code that does no real I/O: a wait with nothing scheduled raises instead of
blocking forever.

``tick_s``: how far each turn of the loop that waits for nothing advances the clock (by
default it stands still). Code that waits on a timer computed from the clock can spin
where real time would not: aiolimiter's next token is due a rounding error after now, the
loop runs that timer at once (it is within the clock's resolution), nothing has leaked in
zero elapsed time, and the same timer is set again, forever. A real loop's turn always
takes some time; a tick gives the virtual one that.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class _VirtualTimeSelector(selectors.SelectSelector):
    """Never blocks: a wait of ``timeout`` seconds advances virtual time by that much."""

    def __init__(self, tick_s: float = 0.0) -> None:
        super().__init__()
        self.now = 1000.0  # not zero, so a bug that mixes absolute and relative times shows
        self.tick_s = tick_s

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise RuntimeError("virtual-time loop would wait forever: nothing is scheduled")
        self.now += timeout if timeout > 0 else self.tick_s
        return super().select(0)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, tick_s: float = 0.0) -> None:
        self._virtual = _VirtualTimeSelector(tick_s)
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now
