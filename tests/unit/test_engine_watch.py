"""The supervisor kills an engine that is alive but stuck, on a timer of its own (with or
without a probe port): silent since its last status, silent since its start, short of
ready past `engine_ready_timeout_s`, or ready with a compute running past `stuck_compute_s`.
Stand-in processes on the tree's injected clock: no child is started."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from app.engine.supervisor import FIRST_STATUS_WITHIN_S, KILL_GRACE_S
from app.engine.zmq_client import STALE_AFTER_S
from app.processes import ProcessTree
from app.settings import Settings
from tests.support.manual_clock import ManualClock
from tests.support.process_tree import StandIn, ready_status

READY_TIMEOUT_S = 300.0
STUCK_COMPUTE_S = 45.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


@pytest.fixture
async def tree(tmp_path: Path, clock: ManualClock) -> AsyncIterator[ProcessTree]:
    # No probe port (the default): nothing asks the probes.
    settings = Settings(
        engine_ready_timeout_s=READY_TIMEOUT_S,
        stuck_compute_s=STUCK_COMPUTE_S,
        max_timeout_ms=1000 * STUCK_COMPUTE_S,  # no deadline outlasts the stuck limit
    )
    tree = ProcessTree(settings, tmp_path, clock=clock)
    tree.frontends = [StandIn(10)]  # type: ignore[list-item]
    tree._heartbeats.started(0)
    yield tree
    tree._zmq.destroy(linger=0)


def spawned(tree: ProcessTree, clock: ManualClock, engine: StandIn) -> None:
    """What the supervisor does when it spawns `engine` now."""
    tree.engine.process = engine  # type: ignore[assignment]
    tree.engine.started_at = clock()


def said(tree: ProcessTree, engine: StandIn, state: str, oldest_compute_s: float = 0.0) -> None:
    """The engine publishes its status now (heard on the tree's clock)."""
    status = msgspec.structs.replace(
        ready_status(engine.pid), state=state, oldest_compute_s=oldest_compute_s
    )
    tree._engine_status.take(status)


def test_a_hung_engine_is_killed_without_a_probe_port(
    tree: ProcessTree, clock: ManualClock
) -> None:
    """The staleness check ran only inside the probe port's answer: without
    STEADY_HEALTH_PORT (the default) an engine whose loop hung was never killed."""
    engine = StandIn(111)
    spawned(tree, clock, engine)
    said(tree, engine, "ready")
    clock.now += STALE_AFTER_S - 1
    tree._check_engine()
    assert not engine.killed
    clock.now += 2  # silent STALE_AFTER_S + 1 since its last status
    tree._check_engine()
    assert engine.killed


def test_an_engine_silent_since_its_start_is_killed(tree: ProcessTree, clock: ManualClock) -> None:
    """A replacement stuck before its first status (a wedged driver in
    `torch.cuda.is_available()`): no status, no age, never killed, /healthz 200."""
    engine = StandIn(222)
    spawned(tree, clock, engine)
    clock.now += FIRST_STATUS_WITHIN_S - 1  # importing torch may take a while
    tree._check_engine()
    assert not engine.killed
    clock.now += 2
    tree._check_engine()
    assert engine.killed


def test_a_dead_engines_status_does_not_count_for_its_replacement(
    tree: ProcessTree, clock: ManualClock
) -> None:
    dead = StandIn(111)
    spawned(tree, clock, dead)
    said(tree, dead, "ready")
    replacement = StandIn(222)
    spawned(tree, clock, replacement)
    clock.now += FIRST_STATUS_WITHIN_S + 1
    said(tree, dead, "ready")  # the dead one's late word, not the replacement's
    tree._check_engine()
    assert replacement.killed


@pytest.mark.parametrize("state", ["loading", "warming_up"])
def test_an_engine_short_of_ready_past_the_timeout_is_killed(
    tree: ProcessTree, clock: ManualClock, state: str
) -> None:
    """A replacement that published `loading` and then hung in a compute thread (its loop
    still publishing): NotReady for ever, and /healthz 200."""
    engine = StandIn(333)
    spawned(tree, clock, engine)
    for _ in range(int(READY_TIMEOUT_S) - 1):
        clock.now += 1
        said(tree, engine, state)  # its heartbeat goes on: never stale
        tree._check_engine()
    assert not engine.killed
    clock.now += 2
    said(tree, engine, state)
    tree._check_engine()
    assert engine.killed


@pytest.mark.parametrize("state", ["ready", "failed"])
def test_a_ready_or_failed_engine_is_not_killed_for_its_age(
    tree: ProcessTree, clock: ManualClock, state: str
) -> None:
    """A failed start-up stays up, failed, for /healthz to report (no restart loop)."""
    engine = StandIn(444)
    spawned(tree, clock, engine)
    clock.now += READY_TIMEOUT_S * 2
    said(tree, engine, state)
    tree._check_engine()
    assert not engine.killed


def test_a_ready_engine_whose_compute_never_returns_is_killed(
    tree: ProcessTree, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A wedged GPU: a batch's CUDA sync never returns, while the engine's loop goes on
    publishing `ready` every 0.1 s. Never stale, never failed: /readyz and /healthz said
    200 for ever, and every request waited out its deadline."""
    engine = StandIn(777)
    spawned(tree, clock, engine)
    said(tree, engine, "ready")
    tree._check_engine()
    for age_s in range(1, int(STUCK_COMPUTE_S)):
        clock.now += 1
        said(tree, engine, "ready", oldest_compute_s=age_s)
        tree._check_engine()
    assert not engine.killed
    clock.now += 2
    said(tree, engine, "ready", oldest_compute_s=STUCK_COMPUTE_S + 1)
    tree._check_engine()
    assert engine.killed
    assert "STEADY_STUCK_COMPUTE_S=45" in caplog.text
    assert tree._answer_probe("/readyz")[0] == 503  # the replacement is not ready yet


@pytest.mark.parametrize("state", ["loading", "warming_up", "failed"])
def test_a_long_compute_short_of_ready_is_left_to_the_other_checks(
    tree: ProcessTree, clock: ManualClock, state: str
) -> None:
    """Loading a model and warming it up run on the compute threads too, for minutes on a
    cold cache: the ready timeout bounds those (`test_an_engine_short_of_ready_...`)."""
    engine = StandIn(888)
    spawned(tree, clock, engine)
    clock.now += READY_TIMEOUT_S - 1
    said(tree, engine, state, oldest_compute_s=READY_TIMEOUT_S - 1)
    tree._check_engine()
    assert not engine.killed


async def test_the_check_runs_on_the_supervisors_own_timer(
    tree: ProcessTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks: list[float] = []

    def check() -> None:
        checks.append(time.monotonic())
        if len(checks) == 3:
            tree._stopping = True

    monkeypatch.setattr("app.processes.CHECK_INTERVAL_S", 0.0)
    monkeypatch.setattr(tree, "_check_engine", check)
    await asyncio.wait_for(tree._watch_children(), 10)
    assert len(checks) == 3


async def test_the_supervisor_times_each_engine_from_its_spawn(
    tree: ProcessTree, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[float | None] = []

    def spawn() -> StandIn:
        return StandIn(555)

    async def exits(process: StandIn) -> None:
        seen.append(tree.engine.started_at)
        raise asyncio.CancelledError  # stop the test here

    monkeypatch.setattr(tree.engine, "_spawn", spawn)
    monkeypatch.setattr("app.engine.supervisor.wait_for_exit", exits)
    tree.engine.start()
    assert tree.engine._task is not None
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(tree.engine._task, 10)
    assert seen == [clock()]


def test_an_engine_that_outlives_its_kill_makes_the_pod_unhealthy(
    tree: ProcessTree, clock: ManualClock
) -> None:
    """Stuck in the kernel (a wedged driver), a killed engine never exits, so it is never
    restarted either: only restarting the pod frees the device."""

    class Unkillable(StandIn):
        def kill(self) -> None:
            self.killed = True  # and it runs on

    engine = Unkillable(666)
    spawned(tree, clock, engine)
    clock.now += FIRST_STATUS_WITHIN_S + 1
    tree._check_engine()
    assert engine.killed
    assert tree._answer_probe("/healthz")[0] == 200  # its exit may be on its way
    clock.now += KILL_GRACE_S
    status, body = tree._answer_probe("/healthz")
    assert status == 503 and b"after it was killed" in body


async def test_the_served_tree_watches_its_engine_from_the_start(
    tree: ProcessTree, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tasks the serving tree starts include the engine's check: a stuck engine is
    killed with no probe port and nobody calling `_check_engine` by hand."""

    async def keeps_nothing(index: int) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr("app.processes.CHECK_INTERVAL_S", 0.0)
    monkeypatch.setattr(tree, "_keep_frontend", keeps_nothing)
    engine = StandIn(666)
    spawned(tree, clock, engine)
    clock.now += FIRST_STATUS_WITHIN_S + 1  # stuck before its first status
    watchers = tree._start_watchers()
    try:
        for _ in range(100):  # a few turns of the loop: the check runs on its first
            if engine.killed:
                break
            await asyncio.sleep(0)
        assert engine.killed
    finally:
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
