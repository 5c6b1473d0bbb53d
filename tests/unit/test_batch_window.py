"""The concurrency window the AIMD controller sizes."""

from __future__ import annotations

import asyncio

from app.batchclient.pacing import AimdController
from app.batchclient.window import Window


async def test_window_admits_up_to_the_limit_and_hands_slots_over_in_order() -> None:
    window = Window(AimdController(2, initial=2))
    await window.acquire()
    await window.acquire()
    third = asyncio.create_task(window.acquire())
    fourth = asyncio.create_task(window.acquire())
    await asyncio.sleep(0)
    assert not third.done() and window.in_flight == 2
    window.release()
    await asyncio.sleep(0)
    assert third.done() and not fourth.done()
    fourth.cancel()  # a waiter that gives up leaves no slot taken
    await asyncio.gather(fourth, return_exceptions=True)
    window.release()
    window.release()
    assert window.in_flight == 0


async def test_a_cut_limit_applies_as_holders_leave() -> None:
    controller = AimdController(4, initial=4)
    window = Window(controller)
    for _ in range(4):
        await window.acquire()
    controller.on_congestion(controller.on_send())
    assert controller.limit == 2
    waiter = asyncio.create_task(window.acquire())
    window.release()
    window.release()
    await asyncio.sleep(0)
    assert not waiter.done()  # 2 still in flight: at the new limit
    window.release()
    await asyncio.sleep(0)
    assert waiter.done()
    assert window.in_flight == 2


async def test_a_waiter_cancelled_as_a_slot_frees_leaves_quietly() -> None:
    """`stop` cancels the waiters; a release before the cancelled task ran let `wake` drop
    its (cancelled) future, and the task then failed with ValueError ("not in deque")
    instead of its cancellation, crashing the run it was stopping."""
    window = Window(AimdController(1, initial=1))
    await window.acquire()
    waiter = asyncio.create_task(window.acquire())
    await asyncio.sleep(0)  # waiting for the slot
    waiter.cancel()
    window.release()  # before the waiter's task has run its cancellation
    results = await asyncio.gather(waiter, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert window.in_flight == 0
    await asyncio.wait_for(window.acquire(), 1)  # the slot is free
