"""The event batches of a request's sequences, each read as its own stream, merged into one
stream as they arrive (`generation.pipeline`). Front-end event loop thread only."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import TypeVar

T = TypeVar("T")


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE = object()


async def merge(streams: list[AsyncGenerator[list[T], None]]) -> AsyncGenerator[list[T], None]:
    """The event batches of every stream as they arrive; the first failure ends them all.
    One stream is read directly (no task): the common case costs nothing extra."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as batches:
            async for batch in batches:
                yield batch
        return
    queue: asyncio.Queue[list[T] | _Failed | object] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[list[T], None]) -> None:
        try:
            async with contextlib.aclosing(stream) as batches:
                async for batch in batches:
                    queue.put_nowait(batch)
        except Exception as error:
            queue.put_nowait(_Failed(error))
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, _Failed):
                raise item.error
            elif isinstance(item, list):
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
