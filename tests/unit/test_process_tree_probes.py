"""The supervisor's probe answers (`ProcessTree._answer_probe`) from its view of the engine
and the front ends, with stand-in processes: no child is started."""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from app.drain import ENGINE_STOP_S, STOP_MARGIN_S
from app.engine.protocol import EngineStatus
from app.engine.supervisor import EngineSupervisor, next_backoff
from app.engine.zmq_client import STALE_AFTER_S, EngineAddresses
from app.frontend_process import STARTED
from app.processes import RESTARTS_BEFORE_UNHEALTHY, ProcessTree, drained
from app.settings import Settings


class StandIn:
    """What the tree reads of a child process."""

    def __init__(self, pid: int, alive: bool = True) -> None:
        self.pid = pid
        self.alive = alive
        self.exitcode: int | None = None
        self.killed = False

    def is_alive(self) -> bool:
        return self.alive

    def kill(self) -> None:
        self.killed, self.alive = True, False


def ready_status(pid: int) -> EngineStatus:
    return EngineStatus(
        engine_id=f"engine-{pid}", pid=pid, state="ready", warmup_done=3, warmup_total=3,
        healthy=True, backlog_s=0.0, seconds_per_input=0.0, queued_inputs=0,
        published_at=time.monotonic(),
    )  # fmt: skip


@pytest.fixture
async def tree(tmp_path: Path) -> AsyncIterator[ProcessTree]:
    tree = ProcessTree(Settings(), tmp_path)
    tree.frontends = [StandIn(10)]  # type: ignore[list-item]
    tree._frontends_serving_since = [time.monotonic()]  # its start-up succeeded
    yield tree
    tree._zmq.destroy(linger=0)


def hear(tree: ProcessTree, status: EngineStatus, seconds_ago: float = 0.0) -> None:
    tree._engine_status._status = status
    tree._engine_status._received_at = time.monotonic() - seconds_ago


async def test_ready_needs_the_running_engines_own_status(tree: ProcessTree) -> None:
    tree.engine.process = StandIn(111)  # type: ignore[assignment]
    hear(tree, ready_status(111))
    assert tree._answer_probe("/readyz")[0] == 200
    # It dies and its replacement is loading: the old engine's last status says nothing.
    tree.engine.process = StandIn(222)  # type: ignore[assignment]
    assert tree._answer_probe("/readyz")[0] == 503
    hear(tree, ready_status(222))
    assert tree._answer_probe("/readyz")[0] == 200


async def test_a_front_end_still_starting_cannot_serve(tree: ProcessTree) -> None:
    tree.engine.process = StandIn(111)  # type: ignore[assignment]
    hear(tree, ready_status(111))
    tree._frontends_serving_since[0] = None
    status, body = tree._answer_probe("/readyz")
    assert status == 503 and b"frontend" in body


async def test_an_engine_alive_but_silent_is_killed(tree: ProcessTree) -> None:
    engine = StandIn(111)
    tree.engine.process = engine  # type: ignore[assignment]
    hear(tree, ready_status(111), seconds_ago=STALE_AFTER_S + 1)
    assert tree._answer_probe("/readyz")[0] == 503
    assert engine.killed  # the supervisor starts a fresh one


async def test_an_engine_that_keeps_dying_before_ready_makes_the_pod_unhealthy(
    tree: ProcessTree,
) -> None:
    tree.engine.process = StandIn(111)  # type: ignore[assignment]
    hear(tree, ready_status(111))
    assert tree._answer_probe("/healthz")[0] == 200  # seen ready
    tree._engine_status.forget()
    tree.engine.restarts += RESTARTS_BEFORE_UNHEALTHY - 1
    assert tree._answer_probe("/healthz")[0] == 200  # restarting: readiness covers it
    tree.engine.restarts += 1
    status, body = tree._answer_probe("/healthz")
    assert status == 503 and b"without becoming ready" in body
    tree.engine.process = StandIn(222)  # type: ignore[assignment]
    hear(tree, ready_status(222))  # a replacement that made it
    assert tree._answer_probe("/healthz")[0] == 200


def test_a_front_end_killed_by_the_drain_signal_before_its_handler_drained_as_asked() -> None:
    """SIGUSR1 in a front end's first ~0.2 s (before start-up installs its handler) kills it
    by the default action: that is the stop the operator asked for, not a failure that
    makes the server exit 1."""
    assert drained(0) and drained(-signal.SIGUSR1)
    assert not drained(1)  # a failed start-up
    assert not drained(-signal.SIGKILL) and not drained(None)


async def test_a_server_whose_front_end_took_the_drain_signal_early_exits_0(
    tree: ProcessTree,
) -> None:
    """Killed by SIGUSR1 before its handler was set, a front end drained as asked: the
    server exited 1, as if that front end had failed."""
    frontend = tree.frontends[0]
    frontend.exitcode = -signal.SIGUSR1
    assert tree.exit_status() == 0
    frontend.exitcode = 1  # a failed start-up
    assert tree.exit_status() == 1


async def test_a_server_whose_engines_recovered_exits_0_without_a_probe_port(
    tree: ProcessTree,
) -> None:
    """Engines that died now and then over a long life, each replacement heard ready: not a
    crash loop, though no probe port ever asked (the readiness was counted only there)."""
    for frontend in tree.frontends:
        frontend.exitcode = 0
    tree.engine.process = StandIn(333)  # type: ignore[assignment]
    tree.engine.restarts += RESTARTS_BEFORE_UNHEALTHY
    tree._engine_said(ready_status(333))
    assert tree.exit_status() == 0


async def test_a_server_stopped_while_its_engine_crash_loops_exits_1(tree: ProcessTree) -> None:
    """Kubernetes probes liveness only after start-up succeeded: a pod whose engine dies at
    every start is stopped when its startup probe gives up, and exited 0 ("Completed")."""
    for frontend in tree.frontends:
        frontend.exitcode = 0  # drained as asked
    tree.engine.restarts += RESTARTS_BEFORE_UNHEALTHY - 1
    assert tree.exit_status() == 0  # not (yet) a crash loop
    tree.engine.restarts += 1
    assert tree.exit_status() == 1


async def test_a_probe_port_in_use_stops_the_server_before_any_child_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Children ignore SIGTERM: started before the probe port failed, they kept the
    # supervisor's exit waiting on them forever.
    started: list[str] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        tree = ProcessTree(Settings(host="127.0.0.1", health_port=port), tmp_path)
        monkeypatch.setattr(tree.engine, "start", lambda: started.append("engine"))
        monkeypatch.setattr(tree, "_spawn_frontend", lambda index: started.append("front end"))
        assert await tree.run() == 2
    assert started == []


async def test_an_engine_that_cannot_be_spawned_is_tried_again_with_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(engine_restart_backoff_s=(0.001, 0.002))
    supervisor = EngineSupervisor(settings, EngineAddresses.in_directory(tmp_path))
    # What each try saw of `_one_died`, checked once the task has ended: an assertion in
    # the stand-in `_spawn` would be caught by the supervisor's `except Exception` and
    # retried forever, so a regression would hang the suite instead of failing it.
    replacement_seen: list[bool] = []

    def spawn() -> None:
        replacement_seen.append(supervisor._one_died)
        if len(replacement_seen) < 3:
            raise OSError(11, "Resource temporarily unavailable")  # EAGAIN: the pid limit
        raise asyncio.CancelledError  # the third try: stop the test here

    monkeypatch.setattr(supervisor, "_spawn", spawn)
    supervisor.start()
    assert supervisor._task is not None
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(supervisor._task, 10)  # a TimeoutError fails, not hangs
    # No engine has died: none of the three that start is a replacement (restarts counter).
    assert replacement_seen == [False, False, False]
    assert supervisor.restarts == 2


async def test_an_engine_that_dies_once_the_server_is_stopping_is_not_restarted(
    tree: ProcessTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restarted during the front ends' drain, an engine loaded its model only to be stopped
    mid-load, and shutdown outlasted the pod's grace period."""
    spawned: list[int] = []
    monkeypatch.setattr(tree.engine, "_spawn", lambda: spawned.append(1))
    tree._on_signal(signal.SIGTERM)
    tree.engine.start()
    assert tree.engine._task is not None
    await tree.engine._task  # ends at once: nothing is spawned
    assert spawned == []


async def test_hung_front_ends_share_one_drain_deadline(
    tree: ProcessTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each join got a fresh drain_timeout_s + 10: k hung front ends took k times as long,
    past the pod's grace period."""
    clock = [1000.0]
    waits: list[float] = []

    class Hung(StandIn):
        def join(self, timeout: float | None = None) -> None:
            waits.append(timeout or 0.0)
            clock[0] += timeout or 0.0  # it never exits: the whole wait passes

    tree.frontends = [Hung(11), Hung(12)]  # type: ignore[list-item]
    monkeypatch.setattr("app.processes.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("app.processes.os.kill", lambda pid, sig: None)
    await tree._drain_frontends(clock[0] + 70)
    assert waits == [70, 5, 0.0, 5]  # each killed after its join; the second waits no more


async def test_hung_front_ends_and_engine_are_stopped_within_one_budget(
    tree: ProcessTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The front ends' wait (drain + 10 s) and the engine's (10 s more) added up past the
    pod's grace period: the kubelet's SIGKILL cut the stop short."""
    clock = [1000.0]
    engine_timeouts: list[float] = []

    class Hung(StandIn):
        def join(self, timeout: float | None = None) -> None:
            if self.alive:  # the whole wait passes; once killed, it is reaped at once
                clock[0] += timeout or 0.0

    async def engine_stop(timeout_s: float = 10.0) -> None:
        engine_timeouts.append(timeout_s)
        clock[0] += timeout_s  # hung too: killed when its wait ends

    tree.frontends = [Hung(11), Hung(12)]  # type: ignore[list-item]
    monkeypatch.setattr("app.processes.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("app.processes.os.kill", lambda pid, sig: None)
    monkeypatch.setattr(tree.engine, "stop", engine_stop)
    stop_by = clock[0] + tree.settings.drain_timeout_s + STOP_MARGIN_S
    await tree._stop_children(stop_by)
    assert engine_timeouts == [ENGINE_STOP_S]  # what the front ends left of the budget
    assert clock[0] == stop_by


async def test_a_front_end_whose_restart_cannot_be_spawned_is_tried_again(
    tree: ProcessTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spawn that raised (pid limit, memory) ended the slot's watcher: never refilled."""
    tree.settings = Settings(engine_restart_backoff_s=(0.001, 0.002))

    async def exited_at_once(process: object) -> None:
        return None

    monkeypatch.setattr("app.processes.wait_for_exit", exited_at_once)
    monkeypatch.setattr("app.processes._forget_metrics_of", exited_at_once)
    monkeypatch.setattr(tree, "_tell_engine_frontend_gone", lambda pid: None)
    tries: list[int] = []

    def spawn(index: int) -> None:
        tries.append(index)
        if len(tries) < 3:
            raise OSError(11, "Resource temporarily unavailable")
        tree._stopping = True  # the third start succeeds; then the server stops

    monkeypatch.setattr(tree, "_spawn_frontend", spawn)
    await asyncio.wait_for(tree._keep_frontend(0), timeout=10)
    assert tries == [0, 0, 0]


async def test_a_dead_front_ends_counters_are_folded_into_the_archive(
    tree: ProcessTree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only its live gauges were dropped: a crash-looping front end left thousands of
    counter and histogram files a day, each parsed by every scrape."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from app.metrics import MULTIPROCESS_DIR_ENV

    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    monkeypatch.setenv(MULTIPROCESS_DIR_ENV, str(metrics_dir))
    written = MmapedDict(str(metrics_dir / "counter_10.db"))
    written.write_value(mmap_key("steadyserve_demo", "steadyserve_demo_total", [], [], "d"), 3, 0)
    written.close()

    async def exited_at_once(process: object) -> None:
        return None

    def spawn(index: int) -> None:
        tree._stopping = True  # restarted; then the server stops

    monkeypatch.setattr("app.processes.wait_for_exit", exited_at_once)
    monkeypatch.setattr(tree, "_tell_engine_frontend_gone", lambda pid: None)
    monkeypatch.setattr(tree, "_spawn_frontend", spawn)
    tree.settings = Settings(engine_restart_backoff_s=(0.001, 0.002))
    await asyncio.wait_for(tree._keep_frontend(0), timeout=10)
    assert sorted(path.name for path in metrics_dir.glob("*.db")) == ["counter_archive.db"]


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
        tree.frontends[index], tree._frontends_serving_since[index] = spawned[-1], None  # type: ignore[call-overload]

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
    monkeypatch.setattr("app.processes._forget_metrics_of", nothing)
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
    tree._frontends_serving_since = [None]
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
    with nothing said) never serves, and its pipe is closed."""
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
        heard.set()

    monkeypatch.setattr(tree, "_context", SpawnStandIn(act))
    monkeypatch.setattr(tree, "_heard_frontend", heard_frontend)
    try:
        tree._spawn_frontend(0)
        await asyncio.wait_for(heard.wait(), timeout=10)
    finally:
        tree._zmq.destroy(linger=0)
    assert tree._frontends_serving_since == [1000.0 if succeeds else None]
    assert pipes[0].closed
