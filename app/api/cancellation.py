"""Abort a request's work when its client disconnects (as vLLM's `with_cancellation`).

Starlette does not cancel a handler when the client goes away; without this, a dropped
client's inputs would still be batched and computed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def _cancel_on_disconnect(request: Request, handler: asyncio.Task[Any]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handler.cancel(_DISCONNECTED)
            return


_DISCONNECTED = "client disconnected"


async def run_until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work` in the calling task; cancel it and raise `ClientDisconnected` if the
    client disconnects first. Event loop thread only; call after the body has been read.

    The work runs in the handler's own task, and only the watcher is a new task: one task
    per request instead of two plus an `asyncio.wait`, on the path every request takes.
    """
    handler = asyncio.current_task()
    assert handler is not None, "run_until_disconnect runs inside a task"
    watcher = asyncio.create_task(_cancel_on_disconnect(request, handler))
    try:
        return await work
    except asyncio.CancelledError as cancelled:
        # Ours (the watcher's message) becomes ClientDisconnected; anyone else's propagates.
        # `work` has unwound by now: its inputs left the queue, its admission was released.
        if cancelled.args == (_DISCONNECTED,) and watcher.done():
            handler.uncancel()
            raise ClientDisconnected from None
        raise
    finally:
        watcher.cancel()
