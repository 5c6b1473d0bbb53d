"""Abort a request's work when its client disconnects (as vLLM's `with_cancellation`).

Starlette does not cancel a handler when the client goes away; without this, a dropped
client's inputs would still be batched and computed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work`; cancel it and raise `ClientDisconnected` if the client disconnects first.
    Event loop thread only; call after the body has been read."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        raise
    finally:
        watcher.cancel()
    if work_task.done():
        return work_task.result()
    work_task.cancel()
    # Wait for the work to unwind (its inputs leave the queue, its admission is released)
    # so nothing of it is left half-done when the handler returns.
    with contextlib.suppress(asyncio.CancelledError):
        await work_task
    raise ClientDisconnected
