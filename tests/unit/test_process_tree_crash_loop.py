"""A tree whose front ends keep dying before they have served a minute is a pod problem on
the supervisor's /healthz, as an engine that keeps dying before it is ready is: the real
`ProcessTree._keep_frontend` restarting stand-in front ends on an injected clock (no child
is started)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.crash_loop import RESTARTS_BEFORE_UNHEALTHY
from app.engine.supervisor import STABLE_AFTER_S
from app.processes import ProcessTree
from app.settings import Settings
from tests.support.process_tree import StandIn

LOOPING = f"every front end restarted {RESTARTS_BEFORE_UNHEALTHY} times without serving for 60 s"


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[ProcessTree]:
    """Two front ends, both serving since the tree's clock began; fast restart backoffs."""
    clock = [1000.0]
    tree = ProcessTree(
        Settings(engine_restart_backoff_s=(0.001, 0.004)), tmp_path, clock=lambda: clock[0]
    )
    tree.frontends = [StandIn(10), StandIn(11)]  # type: ignore[list-item]
    for index in (0, 1):
        tree._heartbeats.started(index)
    tree.clock = clock  # type: ignore[attr-defined]
    yield tree
    tree._zmq.destroy(linger=0)


async def die(
    tree: ProcessTree,
    monkeypatch: pytest.MonkeyPatch,
    index: int,
    deaths: int,
    run_s: float,
    serving_after_s: float | None,
) -> None:
    """Front end `index` dies `deaths` times, each `run_s` after its (re)start, heard to
    start serving `serving_after_s` into its run (never when None: its start-up fails);
    `_keep_frontend` restarts it each time but the last."""
    clock: list[float] = tree.clock  # type: ignore[attr-defined]
    spawned: list[StandIn] = []

    def spawn(index: int) -> None:
        if len(spawned) == deaths - 1:
            raise asyncio.CancelledError  # the test is done with this front end
        spawned.append(StandIn(400 + 10 * index + len(spawned)))
        tree.frontends[index] = spawned[-1]  # type: ignore[call-overload]
        tree._heartbeats.spawned(index)

    async def runs(process: StandIn) -> None:
        if serving_after_s is not None:
            clock[0] += serving_after_s
            tree._frontend_started(index, process)  # type: ignore[arg-type]
        clock[0] += run_s - (serving_after_s or 0.0)

    async def nothing(*args: object) -> None:
        return None

    if serving_after_s is None:
        tree._heartbeats.spawned(index)  # the first one, too, never served
    monkeypatch.setattr(tree, "_spawn_frontend", spawn)
    monkeypatch.setattr(tree, "_tell_engine_frontend_gone", lambda pid: None)
    monkeypatch.setattr("app.processes.wait_for_exit", runs)
    monkeypatch.setattr("app.processes.forget_dead_process", nothing)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(tree._keep_frontend(index), timeout=10)


def healthz(tree: ProcessTree) -> tuple[int, str | None]:
    status, body = tree._answer_probe("/healthz")
    return status, json.loads(body).get("problem")


@pytest.mark.parametrize(
    ("run_s", "serving_after_s"),
    [(5.0, None), (35.0, 5.0)],
    ids=["start-up-fails", "killed-as-hung"],
)
async def test_front_ends_that_all_keep_dying_before_serving_a_minute_make_the_pod_unhealthy(
    tree: ProcessTree,
    monkeypatch: pytest.MonkeyPatch,
    run_s: float,
    serving_after_s: float | None,
) -> None:
    """Every front end failing its start-up, or killed 30 s after its loop hung 5 s in:
    /readyz said 503 for ever and /healthz 200, so Kubernetes never restarted the pod."""
    await die(tree, monkeypatch, 0, RESTARTS_BEFORE_UNHEALTHY, run_s, serving_after_s)
    assert healthz(tree) == (200, None)  # front end 1 serves: so does the pod
    await die(tree, monkeypatch, 1, RESTARTS_BEFORE_UNHEALTHY - 1, run_s, serving_after_s)
    assert healthz(tree) == (200, None)  # not yet a loop
    await die(tree, monkeypatch, 1, 1, run_s, serving_after_s)
    assert healthz(tree) == (503, LOOPING)
    assert tree.exit_status() == 1
    # One serving for a minute now is out of its loop, and the pod with it.
    tree.frontends[0] = StandIn(500)  # type: ignore[call-overload]
    tree._heartbeats.spawned(0)
    tree._heartbeats.started(0)
    tree.clock[0] += STABLE_AFTER_S - 1  # type: ignore[attr-defined]
    assert healthz(tree) == (503, LOOPING)
    tree.clock[0] += 1  # type: ignore[attr-defined]
    assert healthz(tree) == (200, None)


async def test_front_ends_that_left_their_loop_stop_cleanly(
    tree: ProcessTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Crash-looping once, then serving for a minute: the loop is over, at the stop too
    (its front ends exit then without their deaths being counted)."""
    for index in (0, 1):
        await die(tree, monkeypatch, index, RESTARTS_BEFORE_UNHEALTHY, 5.0, None)
    assert healthz(tree) == (503, LOOPING)
    for index in (0, 1):
        tree.frontends[index] = StandIn(500 + index)  # type: ignore[call-overload]
        tree._heartbeats.spawned(index)
        tree._heartbeats.started(index)
    tree.clock[0] += STABLE_AFTER_S  # type: ignore[attr-defined]
    assert healthz(tree) == (200, None)
    for process in tree.frontends:
        process.exitcode = 0  # type: ignore[misc]
    assert tree.exit_status() == 0


async def test_front_ends_that_die_after_a_minute_serving_are_no_crash_loop(
    tree: ProcessTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    for index in (0, 1):
        await die(tree, monkeypatch, index, 2 * RESTARTS_BEFORE_UNHEALTHY, 70.0, 5.0)
    assert healthz(tree) == (200, None)
