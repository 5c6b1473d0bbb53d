"""A front end whose event loop hangs is noticed and replaced: it sends heartbeats on its start
pipe from that loop (`StartPipe`), the supervisor counts it ready only while it hears them
and kills it once they stop (`FrontendHeartbeats`, `ProcessTree._check_frontends`).

A hung front end's process lived and its socket stayed in the port's SO_REUSEPORT group: the
kernel still gave it its share of new connections, which waited in its backlog until their
clients timed out, while /readyz and /healthz said 200, even with every front end hung.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import struct
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

import pytest

from app.engine.orphans import die_with_parent
from app.engine.zmq_client import EngineAddresses
from app.frontend_heartbeats import SILENT_AFTER_S, FrontendHeartbeats
from app.frontend_process import HEARTBEAT, STARTED, StartPipe
from app.processes import ProcessTree
from app.settings import Settings
from app.stopping import kill_now
from tests.support.manual_clock import ManualClock
from tests.support.process_tree import StandIn, ready_status

# --- the staleness decision, on an injected clock ------------------------------------------


def test_a_front_end_is_heartbeating_from_its_start_until_silent_past_the_limit() -> None:
    clock = ManualClock(1000.0)
    beats = FrontendHeartbeats(clock, silent_after_s=5.0)
    beats.spawned(0)
    beats.beat(0)  # nothing counts before its start-up says it succeeded
    assert not beats.heartbeating(0) and beats.serving_since(0) is None
    clock.now += 600  # a long start-up: it takes no connection yet, so it is never overdue
    assert beats.overdue(0) is None
    beats.started(0)
    assert beats.heartbeating(0) and beats.serving_since(0) == 1600.0
    clock.now += 4.0
    beats.beat(0)
    clock.now += 5.0  # silent exactly the limit: still heartbeating
    assert beats.heartbeating(0) and beats.overdue(0) is None
    clock.now += 0.5
    assert not beats.heartbeating(0)
    assert beats.overdue(0) == "has sent no heartbeat for 5.5 s (its event loop is hung)"
    beats.beat(0)  # its loop recovered before the check: it lives
    assert beats.heartbeating(0) and beats.overdue(0) is None


def test_a_front_end_given_up_on_is_never_heard_again_but_keeps_its_serving_time() -> None:
    clock = ManualClock(1000.0)
    beats = FrontendHeartbeats(clock, silent_after_s=5.0)
    beats.started(0)
    beats.started(1)
    clock.now += 6.0
    beats.beat(1)
    assert beats.overdue(0) is not None and beats.overdue(1) is None
    beats.give_up(0)  # being killed
    beats.beat(0)  # a beat it wrote before it hung, read late
    assert not beats.heartbeating(0) and beats.overdue(0) is None
    assert beats.serving_since(0) == 1000.0  # its restart's backoff counts it
    beats.spawned(0)  # its replacement
    assert beats.serving_since(0) is None and beats.heartbeating(1)


# --- the supervisor's view, with stand-in processes ----------------------------------------


@pytest.fixture
async def tree(tmp_path: Path) -> AsyncIterator[ProcessTree]:
    tree = ProcessTree(Settings(), tmp_path, clock=ManualClock(1000.0))
    tree.frontends = [StandIn(10), StandIn(11)]  # type: ignore[list-item]
    tree.engine.process = StandIn(111)  # type: ignore[assignment]
    for index in (0, 1):
        tree._heartbeats.started(index)
    yield tree
    tree._zmq.destroy(linger=0)


def later(tree: ProcessTree, seconds: float) -> None:
    """`seconds` pass; the engine went on publishing `ready` meanwhile."""
    tree._clock.now += seconds  # type: ignore[attr-defined]
    tree._engine_status.take(ready_status(111))


def test_a_pod_whose_front_ends_all_hung_is_not_ready(tree: ProcessTree) -> None:
    """Readiness asked only whether a front end was alive and had started: with every
    front end's loop hung, the pod said ready and Envoy sent it traffic nobody answered."""
    later(tree, 0)
    assert tree._answer_probe("/readyz")[0] == 200
    later(tree, SILENT_AFTER_S - 1)
    tree._heartbeats.beat(1)
    later(tree, 2)  # front end 0 silent past the limit, 1 not
    assert tree._answer_probe("/readyz")[0] == 200
    later(tree, SILENT_AFTER_S)  # both silent: not yet killed (the check runs every second)
    status, body = tree._answer_probe("/readyz")
    assert status == 503 and b"frontend_unavailable" in body


def test_a_front_end_silent_past_the_limit_is_killed_once_and_counted(
    tree: ProcessTree, caplog: pytest.LogCaptureFixture
) -> None:
    later(tree, SILENT_AFTER_S - 1)
    tree._heartbeats.beat(1)
    tree._check_frontends()
    assert not any(process.killed for process in tree.frontends)  # type: ignore[attr-defined]
    later(tree, 1.5)
    with caplog.at_level(logging.ERROR, logger="app.processes"):
        tree._check_frontends()
        tree._check_frontends()  # killed already: its exit is on its way
    assert [process.killed for process in tree.frontends] == [True, False]  # type: ignore[attr-defined]
    assert tree.hung_frontends == 1
    assert caplog.messages == [
        f"front end 10 has sent no heartbeat for {SILENT_AFTER_S + 0.5:.1f} s (its event loop "
        "is hung): killing it (hung #1)"
    ]
    assert tree._answer_probe("/readyz")[0] == 200  # front end 1 serves


def test_a_silent_front_end_is_left_to_the_drain_once_the_server_stops(
    tree: ProcessTree,
) -> None:
    later(tree, SILENT_AFTER_S + 1)
    tree._stopping = True
    tree._check_frontends()
    assert not any(process.killed for process in tree.frontends)  # type: ignore[attr-defined]


# --- the front end's end of the pipe --------------------------------------------------------


async def receive(pipe: Connection) -> bytes | None:
    """The next message on `pipe`, awaited on the loop; None at EOF."""
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(pipe.fileno(), on_readable)
    try:
        await asyncio.wait_for(readable, 10)
    finally:
        loop.remove_reader(pipe.fileno())
    try:
        return pipe.recv_bytes()
    except EOFError:
        return None


async def test_a_front_end_says_it_started_then_beats_from_its_loop() -> None:
    heard, started = Pipe(duplex=False)
    start_pipe = StartPipe(started, interval_s=0.001)
    start_pipe.on_started(True)
    assert [await receive(heard) for _ in range(3)] == [STARTED, HEARTBEAT, HEARTBEAT]
    assert start_pipe._beats is not None
    start_pipe._beats.cancel()
    started.close()
    heard.close()


async def test_a_front_end_whose_start_up_failed_closes_its_pipe_with_nothing_said() -> None:
    heard, started = Pipe(duplex=False)
    StartPipe(started).on_started(False)
    assert await receive(heard) is None
    heard.close()


async def test_a_full_pipe_drops_beats_without_blocking_the_loop() -> None:
    """The supervisor's loop held up: its pipe fills, and a blocking write would hang the
    front end's loop on the supervisor's. The beats left whole are read once it catches up."""
    heard, started = Pipe(duplex=False)
    start_pipe = StartPipe(started, interval_s=0.0)
    start_pipe.on_started(True)
    assert [await receive(heard) for _ in range(2)] == [STARTED, HEARTBEAT]
    assert not os.get_blocking(started.fileno())  # else a full pipe would hang the loop
    # Filled through a file of its own, whose flags are not the front end's.
    filler = os.open(f"/proc/self/fd/{started.fileno()}", os.O_WRONLY | os.O_NONBLOCK)
    framed = struct.pack("!i", len(HEARTBEAT)) + HEARTBEAT  # as `send_bytes` writes one
    written = 0
    try:
        with pytest.raises(BlockingIOError):
            while True:  # the same whole messages, until the pipe is full
                os.write(filler, framed)
                written += 1
    finally:
        os.close(filler)
    for _ in range(100):  # loop turns, each a beat tried on the full pipe: none blocks
        await asyncio.sleep(0)
    assert start_pipe._beats is not None and not start_pipe._beats.done()
    read = 0
    while heard.poll():  # every message whole: the full pipe took no part of one
        assert heard.recv_bytes() == HEARTBEAT
        read += 1
    assert read >= written
    assert await receive(heard) == HEARTBEAT  # room again: the beats go on
    start_pipe._beats.cancel()
    started.close()
    heard.close()


# --- real processes: a front end whose loop hangs is killed and replaced ------------------

BEAT_S = 0.02
SILENT_S = 1.0  # the test tree's limit: 50 beats
HANG_AFTER_S = 1.5  # a front end beats this long (past the limit, unharmed), then hangs


def hanging_frontend(
    settings: Settings,
    addresses: EngineAddresses,
    processes: int,
    started: Connection,
    parent_pid: int,
    created: int,
    token: int,
    replacing: str | None,
) -> None:
    """A front-end process (`run_frontend_process`'s arguments) whose start pipe is driven
    as a front end's is (`StartPipe`), on an event loop that blocks for good once it has
    beaten for `HANG_AFTER_S`, as one stuck in a C extension or a deadlock does."""
    die_with_parent(parent_pid)

    async def serve() -> None:
        StartPipe(started, interval_s=BEAT_S).on_started(True)
        await asyncio.sleep(HANG_AFTER_S)  # serving, heartbeats going out
        threading.Event().wait()  # hung: the loop never turns again

    asyncio.run(serve())


async def test_a_front_end_whose_loop_hangs_is_killed_and_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its process lived, so the supervisor, which waited only for its exit, never
    restarted it."""
    tree = ProcessTree(Settings(engine_restart_backoff_s=(0.001, 0.002)), tmp_path)
    tree._heartbeats.silent_after_s = SILENT_S

    async def nothing(pid: int) -> None:
        return None

    monkeypatch.setattr("app.processes.run_frontend_process", hanging_frontend)
    monkeypatch.setattr("app.processes.CHECK_INTERVAL_S", BEAT_S)
    monkeypatch.setattr("app.processes.forget_dead_process", nothing)
    monkeypatch.setattr(tree, "_tell_engine_frontend_gone", lambda pid: None)
    started_at: list[float] = []
    given_up_at: list[float] = []
    replaced = asyncio.Event()
    really_started, really_give_up = tree._frontend_started, tree._heartbeats.give_up

    def frontend_started(index: int, process: object) -> None:
        really_started(index, process)  # type: ignore[arg-type]
        started_at.append(time.monotonic())
        if len(started_at) == 2:
            replaced.set()

    def give_up(index: int) -> None:
        given_up_at.append(time.monotonic())
        really_give_up(index)

    monkeypatch.setattr(tree, "_frontend_started", frontend_started)
    monkeypatch.setattr(tree._heartbeats, "give_up", give_up)
    tree._spawn_frontend(0)
    first = tree.frontends[0]
    watchers = [
        asyncio.create_task(tree._keep_frontend(0)),
        asyncio.create_task(tree._watch_children()),
    ]
    try:
        with caplog.at_level(logging.ERROR, logger="app.processes"):
            await asyncio.wait_for(replaced.wait(), 60)
    finally:
        tree._stopping = True
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        kill_now([first, *tree.frontends], reap=True)
        tree._zmq.destroy(linger=0)
    assert first.exitcode == -signal.SIGKILL
    assert tree.frontends[0] is not first
    assert tree.hung_frontends == 1
    assert f"front end {first.pid} has sent no heartbeat for" in caplog.text
    # Beating, it was left alone past the limit; killed only once its loop had hung.
    assert given_up_at[0] - started_at[0] >= HANG_AFTER_S
