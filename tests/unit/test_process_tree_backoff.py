"""The process tree's restart backoffs (the engine's after a minute ready, a front end's
after a minute serving, on the tree's injected clock) and the front ends' start pipe, with
stand-in processes: no child is started."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from app.engine.supervisor import EngineSupervisor, next_backoff
from app.engine.zmq_client import EngineAddresses
from app.frontend_process import STARTED
from app.processes import ProcessTree
from app.settings import Settings
from tests.support.process_tree import StandIn, ready_status


def dying_engines(
    supervisor: EngineSupervisor,
    monkeypatch: pytest.MonkeyPatch,
    clock: list[float],
    ready_after_s: float | None,
) -> list[float]:
    """Engines that each run 70 s and die, heard ready `ready_after_s` into their run (never
    when None); the fifth spawn stops the supervisor. Returns the backoffs it chose."""
    backoffs: list[float] = []
    spawned: list[StandIn] = []

    def spawn() -> StandIn:
        if len(spawned) == 4:
            raise asyncio.CancelledError
        spawned.append(StandIn(300 + len(spawned)))
        return spawned[-1]

    async def runs_70_s(process: StandIn) -> None:
        if ready_after_s is not None:
            clock[0] += ready_after_s
            supervisor.saw_ready(process.pid)
            clock[0] += 70 - ready_after_s
        else:
            clock[0] += 70

    def recorded(previous_s: float | None, first_s: float, longest_s: float) -> float:
        backoffs.append(next_backoff(previous_s, first_s, longest_s))
        return backoffs[-1]

    monkeypatch.setattr(supervisor, "_spawn", spawn)
    monkeypatch.setattr("app.engine.supervisor.wait_for_exit", runs_70_s)
    monkeypatch.setattr("app.engine.supervisor.next_backoff", recorded)
    return backoffs


@pytest.mark.parametrize(
    ("ready_after_s", "expected"),
    [
        # Crash-looping in a warm-up over a minute long: never ready, the backoff grows.
        (None, [0.001, 0.002, 0.004, 0.004]),
        # Ready 50 s in, dead 20 s later: not a stable engine either.
        (50.0, [0.001, 0.002, 0.004, 0.004]),
        # Ready 5 s in, for 65 s: stable, each death starts the backoff over.
        (5.0, [0.001, 0.001, 0.001, 0.001]),
    ],
)
async def test_the_engine_restart_backoff_resets_after_a_minute_ready_not_running(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ready_after_s: float | None,
    expected: list[float],
) -> None:
    """It reset after a minute of the engine running: an engine crash-looping in a warm-up
    longer than that was restarted at the first wait forever."""
    clock = [1000.0]
    settings = Settings(engine_restart_backoff_s=(0.001, 0.004))
    supervisor = EngineSupervisor(
        settings, EngineAddresses.in_directory(tmp_path), clock=lambda: clock[0]
    )
    backoffs = dying_engines(supervisor, monkeypatch, clock, ready_after_s)
    supervisor.start()
    assert supervisor._task is not None
    with pytest.raises(asyncio.CancelledError):
        await supervisor._task
    assert backoffs == expected


async def test_the_tree_tells_the_supervisor_when_its_engine_is_ready(tree: ProcessTree) -> None:
    engine = StandIn(42)
    tree.engine.process = engine  # type: ignore[assignment]
    tree._engine_status.take(ready_status(41))  # another engine's (a dead one's)
    tree._engine_status.forget()
    assert tree.engine._ready_since is None
    tree._engine_status.take(ready_status(42))
    assert tree.engine._ready_since is not None


def dying_frontends(
    tree: ProcessTree,
    monkeypatch: pytest.MonkeyPatch,
    clock: list[float],
    serving_after_s: float | None,
) -> list[float]:
    """Front ends that each run 70 s and die, their start-up heard to succeed
    `serving_after_s` into their run (never when None: a 70 s start-up that fails); the
    fourth restart stops the server. Returns the backoffs the supervisor chose."""
    backoffs: list[float] = []
    spawned: list[StandIn] = []

    def spawn(index: int) -> None:
        if len(spawned) == 3:
            tree._stopping = True
        spawned.append(StandIn(400 + len(spawned)))
        tree.frontends[index] = spawned[-1]  # type: ignore[call-overload]
        tree._heartbeats.spawned(index)

    async def runs_70_s(process: StandIn) -> None:
        if tree._stopping:
            return
        if serving_after_s is not None:
            clock[0] += serving_after_s
            tree._frontend_started(0, process)  # type: ignore[arg-type]
            clock[0] += 70 - serving_after_s
        else:
            clock[0] += 70

    async def nothing(*args: object) -> None:
        return None

    def recorded(previous_s: float | None, first_s: float, longest_s: float) -> float:
        backoffs.append(next_backoff(previous_s, first_s, longest_s))
        return backoffs[-1]

    monkeypatch.setattr(tree, "_spawn_frontend", spawn)
    monkeypatch.setattr(tree, "_tell_engine_frontend_gone", lambda pid: None)
    monkeypatch.setattr("app.processes.wait_for_exit", runs_70_s)
    monkeypatch.setattr("app.processes.forget_dead_process", nothing)
    monkeypatch.setattr("app.processes.next_backoff", recorded)
    return backoffs


@pytest.mark.parametrize(
    ("serving_after_s", "expected"),
    [
        # A start-up that takes 70 s and fails: it never served, the backoff grows.
        (None, [0.001, 0.002, 0.004, 0.004]),
        # Serving 50 s in, dead 20 s later: not a stable front end either.
        (50.0, [0.001, 0.002, 0.004, 0.004]),
        # Serving 5 s in, for 65 s: stable, each death starts the backoff over.
        (5.0, [0.001, 0.001, 0.001, 0.001]),
    ],
)
async def test_the_front_end_restart_backoff_resets_after_a_minute_serving_not_running(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    serving_after_s: float | None,
    expected: list[float],
) -> None:
    """It reset after a minute of the front end running: one whose start-up took over a
    minute and then failed was restarted at the first wait forever."""
    clock = [1000.0]
    settings = Settings(engine_restart_backoff_s=(0.001, 0.004))
    tree = ProcessTree(settings, tmp_path, clock=lambda: clock[0])
    tree.frontends = [StandIn(10)]  # type: ignore[list-item]
    backoffs = dying_frontends(tree, monkeypatch, clock, serving_after_s)
    try:
        await asyncio.wait_for(tree._keep_frontend(0), timeout=10)
    finally:
        tree._zmq.destroy(linger=0)
    assert backoffs == expected


class SpawnStandIn:
    """The spawn context, but its processes only do what `act` does with their start pipe."""

    def __init__(self, act: Callable[[Connection], None]) -> None:
        self._act = act
        self.Pipe = multiprocessing.get_context("spawn").Pipe

    def Process(self, target: object, args: tuple[object, ...], name: str) -> StandIn:
        act = self._act
        started = args[3]
        assert isinstance(started, Connection)

        class Child(StandIn):
            def start(self) -> None:
                act(started)

        return Child(500)


@pytest.mark.parametrize("succeeds", [True, False])
async def test_a_front_end_serves_from_when_its_start_pipe_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, succeeds: bool
) -> None:
    """The supervisor hears a front end's start-up succeed on its event loop, at once, and
    times its serving on its own clock from then; one whose start-up failed (its pipe closed
    with nothing said) never serves. Either way the supervisor closes its end at the EOF
    (the front end's exit), not before: the pipe carries the heartbeats after `STARTED`."""
    clock = [1000.0]
    tree = ProcessTree(Settings(), tmp_path, clock=lambda: clock[0])

    def act(started: Connection) -> None:
        if succeeds:
            started.send_bytes(STARTED)
        started.close()  # as the child's end closes when it exits

    heard = asyncio.Event()
    pipes: list[Connection] = []
    really_heard = tree._heard_frontend

    def heard_frontend(index: int, process: StandIn, pipe: Connection) -> None:
        pipes.append(pipe)
        really_heard(index, process, pipe)  # type: ignore[arg-type]
        if pipe.closed:  # the EOF heard
            heard.set()

    monkeypatch.setattr(tree, "_context", SpawnStandIn(act))
    monkeypatch.setattr(tree, "_heard_frontend", heard_frontend)
    try:
        tree._spawn_frontend(0)
        await asyncio.wait_for(heard.wait(), timeout=10)
    finally:
        tree._zmq.destroy(linger=0)
    assert tree._heartbeats.serving_since(0) == (1000.0 if succeeds else None)
    assert tree._heartbeats.heartbeating(0) is succeeds
    assert len(pipes) == (2 if succeeds else 1)  # `STARTED`, then the EOF
