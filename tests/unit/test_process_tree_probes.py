"""The supervisor's probe answers (`ProcessTree._answer_probe`) from its view of the engine
and the front ends, with stand-in processes: no child is started."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.engine.protocol import EngineStatus
from app.engine.zmq_client import STALE_AFTER_S
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
    started = asyncio.Event()
    started.set()
    tree.frontends = [StandIn(10)]  # type: ignore[list-item]
    tree._frontends_started = [started]  # type: ignore[list-item]
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
    tree._frontends_started[0].clear()  # type: ignore[attr-defined]
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
