"""SIGINT and SIGTERM during ``steadyserve batch``: the first stops sending (what is in
flight is answered and written), the second drops what is in flight, any later one is
ignored.

The handlers stay installed until the job has written its journals and its summary:
removed before, a signal in between got Python's default handling, so a third Ctrl-C
raised KeyboardInterrupt (a SIGTERM killed the process) and the summary was lost. While
the job runs synchronous code (closing the journals, writing the summary) the event loop
does not call the handler: a signal then is recorded in the loop's wakeup pipe and
dropped with the handlers, which is the ignoring wanted there.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, TextIO

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stoppable(Protocol):
    """What the signals act on (``BatchClient``)."""

    def stop(self) -> None: ...

    def abort(self) -> None: ...


class Interrupts:
    """The signals a job received, and what each does; the job's event-loop thread only."""

    def __init__(self, client: Stoppable, stream: TextIO) -> None:
        self._client = client
        self._stream = stream
        self.received: list[signal.Signals] = []

    @property
    def first(self) -> signal.Signals | None:
        """The signal that stopped the job, if one did."""
        return self.received[0] if self.received else None

    def handle(self, signum: signal.Signals) -> None:
        """The handler: called by the event loop, in its thread, once per signal."""
        self.received.append(signum)
        if len(self.received) == 1:
            self._stream.write(f"\nbatch: {signum.name}: finishing requests in flight\n")
            self._client.stop()
        elif len(self.received) == 2:
            self._client.abort()
        # Later ones: nothing is left to stop, and the summary is on its way.

    @contextmanager
    def installed(self, loop: asyncio.AbstractEventLoop) -> Iterator[Interrupts]:
        """``handle`` is the loop's handler of SIGINT and SIGTERM inside the block; put the
        whole job in it, its last write included."""
        for signum in SIGNALS:
            loop.add_signal_handler(signum, self.handle, signum)
        try:
            yield self
        finally:
            for signum in SIGNALS:
                loop.remove_signal_handler(signum)
