"""The engine process stops (and its supervisor starts a fresh one) when its request or
status loop ends on its own: it would otherwise take no request, or publish no status,
while running."""

from __future__ import annotations

import asyncio

from app.engine.process import EngineServer


async def test_a_loop_that_ends_on_its_own_stops_the_engine() -> None:
    async def broken() -> None:
        raise ValueError("a bug in the loop")

    stop = asyncio.Event()
    task = asyncio.create_task(broken(), name="engine-requests")
    task.add_done_callback(lambda done: EngineServer._on_task_end(done, stop))
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)  # done callbacks run on the loop's next turn
    assert stop.is_set()


async def test_a_loop_cancelled_at_shutdown_is_not_a_failure() -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(asyncio.Event().wait(), name="engine-status")
    task.add_done_callback(lambda done: EngineServer._on_task_end(done, stop))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert not stop.is_set()
