"""The engine inside the front end's own process and event loop (`STEADY_ENGINE=inprocess`):
the same protocol messages, passed by direct call instead of over a socket. For tests and
debugging; one front-end process only. Event loop thread only."""

from __future__ import annotations

import asyncio

from app.engine.client import EngineUnavailable, StreamingClient
from app.engine.core import EngineCore
from app.engine.protocol import Cancel, DebugQuery, DebugReply, EngineStatus, Submit, ToEngine

_ORIGIN = b"inprocess"


class InProcessEngine(StreamingClient):
    def __init__(self, core: EngineCore) -> None:
        super().__init__(origin=_ORIGIN, clock=core.clock)
        self.core = core
        self._startup: asyncio.Task[None] | None = None

    def status(self) -> EngineStatus | None:
        return self.core.status()

    async def start(self) -> None:
        """Begin loading and warm-up in the background (probes answer meanwhile)."""
        self._startup = asyncio.create_task(self.core.start(), name="engine-startup")

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        if self._startup is not None:
            await asyncio.wait_for(asyncio.shield(self._startup), timeout_s)
        if not self.core.ready:
            raise EngineUnavailable(self.core.status().problem or "the engine is not ready")

    def refresh_metrics(self) -> None:
        self.core.refresh_gauges()

    async def close(self) -> None:
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
            await asyncio.gather(self._startup, return_exceptions=True)
        await self.core.stop()

    def _send(self, message: ToEngine) -> None:
        if isinstance(message, Submit):
            self.core.submit(_ORIGIN, message, self._deliver)
        elif isinstance(message, Cancel):
            self.core.cancel(_ORIGIN, message.request_id)
        elif isinstance(message, DebugQuery):
            report = self.core.debug_report(message.what)
            self._deliver(DebugReply(message.request_id, report))
