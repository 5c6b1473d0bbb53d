"""The dispatcher knows how long its oldest unfinished compute has run, on an injected
clock: the engine publishes it, and the supervisor kills a ready engine whose compute never
returns (a wedged GPU: its loop goes on publishing). Computes here block on an event that
the test sets at the end."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import msgspec
import pytest
import torch

from app.dispatcher import Dispatcher, plan_threads
from app.engine.process import worth_publishing
from tests.support.manual_clock import ManualClock
from tests.support.process_tree import ready_status

WAIT_S = 10.0  # a bound on each wait, never a way to synchronise


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(500.0)


@pytest.fixture
async def dispatcher(clock: ManualClock) -> AsyncIterator[Dispatcher]:
    # torch's own pools as they are: the test changes nothing process-wide.
    plan = plan_threads(2, torch.get_num_threads(), torch.get_num_interop_threads(), 2)
    dispatcher = Dispatcher(plan, torch.device("cpu"), clock)
    yield dispatcher
    dispatcher.shutdown()


async def until_none_runs(dispatcher: Dispatcher) -> None:
    """The compute thread's word that its job ended reaches the loop a turn later."""
    for _ in range(int(WAIT_S * 1000)):
        if dispatcher.oldest_compute_s() == 0.0:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"a compute still runs: {dispatcher.oldest_compute_s()} s")


async def test_a_running_compute_ages_until_it_returns(
    dispatcher: Dispatcher, clock: ManualClock
) -> None:
    release, started = threading.Event(), threading.Event()

    def blocks() -> str:
        started.set()
        assert release.wait(WAIT_S)
        return "done"

    assert dispatcher.oldest_compute_s() == 0.0
    first = asyncio.create_task(dispatcher.run_compute(blocks))
    await asyncio.sleep(0)  # handed over
    clock.now += 40.0
    second = asyncio.create_task(dispatcher.run_compute(lambda: "quick"))
    assert await asyncio.wait_for(second, WAIT_S) == "quick"
    await asyncio.to_thread(started.wait, WAIT_S)
    clock.now += 25.0
    # The oldest one counts, the quick one gone: 65 s of a batch that has not returned.
    assert dispatcher.oldest_compute_s() == pytest.approx(65.0)
    release.set()
    assert await asyncio.wait_for(first, WAIT_S) == "done"
    await until_none_runs(dispatcher)


async def test_a_compute_whose_caller_gave_up_still_counts(
    dispatcher: Dispatcher, clock: ManualClock
) -> None:
    """Cancelling the awaiting task leaves the thread running the job (threads cannot be
    interrupted): it is still the engine's compute, stuck or not."""
    release, started = threading.Event(), threading.Event()

    def blocks() -> None:
        started.set()
        release.wait(WAIT_S)

    caller = asyncio.create_task(dispatcher.run_compute(blocks))
    await asyncio.to_thread(started.wait, WAIT_S)
    caller.cancel()
    await asyncio.gather(caller, return_exceptions=True)
    clock.now += 90.0
    assert dispatcher.oldest_compute_s() == pytest.approx(90.0)
    release.set()
    await until_none_runs(dispatcher)


async def test_a_failed_compute_is_no_longer_running(dispatcher: Dispatcher) -> None:
    def fails() -> None:
        raise ValueError("a bad batch")

    with pytest.raises(ValueError, match="a bad batch"):
        await asyncio.wait_for(dispatcher.run_compute(fails), WAIT_S)
    await until_none_runs(dispatcher)


def test_the_age_of_a_compute_alone_is_not_worth_a_status() -> None:
    """It grows at every 5 ms tick while a batch runs: sent each time, it would send the
    status 200 times a second again; the heartbeat (every 0.1 s) carries it."""
    sent = ready_status(1)
    later = sent.published_at + 0.01
    aged = msgspec.structs.replace(sent, oldest_compute_s=3.0, published_at=later)
    assert not worth_publishing(aged, sent)
    assert worth_publishing(msgspec.structs.replace(aged, queued_inputs=1), sent)
