"""The supervisor's probe answers (`ProcessTree._answer_probe`) from its view of the engine
and the front ends, with stand-in processes: no child is started."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

import pytest

from app.crash_loop import RESTARTS_BEFORE_UNHEALTHY
from app.drain import ENGINE_STOP_S, STOP_MARGIN_S
from app.engine.supervisor import EngineSupervisor
from app.engine.zmq_client import STALE_AFTER_S, EngineAddresses
from app.frontend_process import drained
from app.processes import ProcessTree
from app.settings import Settings
from app.stopping import drain_frontends
from tests.support.process_tree import StandIn, hear, ready_status


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
    tree._heartbeats.spawned(0)  # a new process, still starting
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
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
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
    # Said once, in the log (which is stderr): it was also written to stderr, printed twice.
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if m.startswith("cannot serve the probes: ")]) == 1
    assert capsys.readouterr().err == ""


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
    monkeypatch.setattr("app.stopping.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("app.stopping.os.kill", lambda pid, sig: None)
    await drain_frontends(tree.frontends, clock[0] + 70)
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
    monkeypatch.setattr("app.processes.forget_dead_process", exited_at_once)
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
