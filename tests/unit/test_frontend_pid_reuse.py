"""A dead front end is known by its process, not its pid: the supervisor starts each front
end with a token of its own, in its socket identity (`identity.frontend_identity`), and
`FrontEndGone` carries the pid and that token. It carried the pid alone, and the engine
dropped, unanswered, every Submit whose sender had that pid for `STEADY_MAX_TIMEOUT_MS`
after the death: a front end restarted under the same pid (the kernel reuses them) had
every request wait out its deadline, then answered 503. A real `EngineCore` over the
stand-in model (`tests/support/fake_model.py`), and the process tree with stand-in
processes (no child is started)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import AsyncIterator
from inspect import signature
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from app.engine.core import EngineCore
from app.engine.identity import frontend_identity
from app.engine.protocol import (
    EmbedPayload,
    FromEngine,
    FrontEndGone,
    Output,
    Submit,
    decode_to_engine,
)
from app.frontend_process import run_frontend_process
from app.metrics import Metrics
from app.processes import ProcessTree
from app.settings import Settings
from tests.support.fake_model import GatedLoader
from tests.support.process_tree import StandIn
from tests.support.stand_in_engine import stand_in_settings, submitted

SETTINGS = stand_in_settings("a")
PID = 4242
DEAD, RESTARTED = frontend_identity(PID, 1), frontend_identity(PID, 2)


@pytest.fixture
async def core() -> AsyncIterator[tuple[EngineCore, GatedLoader]]:
    loader = GatedLoader()
    core = EngineCore(SETTINGS, Metrics(), loader=loader)
    await core.start()
    try:
        yield core, loader
    finally:
        for runner in loader.runners.values():
            runner.gate.set()
        await core.stop()


def send(core: EngineCore, origin: bytes, request_id: int) -> asyncio.Future[FromEngine]:
    """One input for model `a` from `origin`; its final answer."""
    request = Submit(request_id, "a", time.monotonic() + 30, EmbedPayload([[1, 5, 2]]))
    return submitted(core, request, origin)


async def test_a_front_end_restarted_under_a_dead_ones_pid_is_served(
    core: tuple[EngineCore, GatedLoader],
) -> None:
    engine, loader = core
    loader.runners["a"].gate.clear()  # the dead front end's request stays in the engine
    orphan = send(engine, DEAD, 1)
    await asyncio.to_thread(loader.runners["a"].started.acquire, timeout=10)
    assert set(engine.status().taken_inputs) == {DEAD}
    engine.frontend_gone(PID, 1)
    assert engine.status().taken_inputs == {}
    assert engine._requests == {}  # its work dropped
    loader.runners["a"].gate.set()
    # The restarted front end, same pid, numbering from 1 again: taken and answered.
    answered = await asyncio.wait_for(send(engine, RESTARTED, 1), 10)
    assert isinstance(answered, Output) and answered.final
    assert engine.status().taken_inputs == {RESTARTED: 1}
    # What the dead one sent, still on its way, is dropped unanswered and uncounted.
    late = send(engine, DEAD, 2)
    assert (DEAD, 2) not in engine._requests and not late.done() and not orphan.done()
    assert engine.status().taken_inputs == {RESTARTED: 1}


class Spawner:
    """The spawn context, its processes stand-ins that start with the pids given, in turn."""

    def __init__(self, pids: list[int]) -> None:
        self.Pipe = multiprocessing.get_context("spawn").Pipe
        self._pids = iter(pids)
        self.tokens: list[int] = []  # each start's token, as the front end is given it

    def Process(self, target: object, args: tuple[object, ...], name: str) -> StandIn:
        token = signature(run_frontend_process).bind(*args).arguments["token"]
        assert isinstance(token, int)
        self.tokens.append(token)
        pid = next(self._pids)

        class Child(StandIn):
            def start(self) -> None:
                pass

        return Child(pid)


async def test_the_supervisor_names_the_front_end_it_started_not_its_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Front end 0 dies and its replacement gets the same pid: each notice names the
    process it is about, by the token that process was started with."""
    tree = ProcessTree(Settings(), tmp_path)
    spawner = Spawner([PID, PID])
    notices: list[FrontEndGone] = []

    def send_now(socket: object, data: bytes) -> bool:
        notice = decode_to_engine(data)
        assert isinstance(notice, FrontEndGone)
        notices.append(notice)
        return True

    monkeypatch.setattr(tree, "_context", spawner)
    monkeypatch.setattr("app.processes.send_now", send_now)
    tree._engine_notices = object()  # type: ignore[assignment]
    closed: list[Connection] = []  # start pipes heard at their EOF (a stand-in writes none)
    really_heard = tree._heard_frontend

    def heard_frontend(index: int, process: StandIn, pipe: Connection) -> None:
        really_heard(index, process, pipe)  # type: ignore[arg-type]
        if pipe.closed:
            closed.append(pipe)

    monkeypatch.setattr(tree, "_heard_frontend", heard_frontend)
    try:
        tree._spawn_frontend(0)
        tree._tell_engine_frontend_gone(PID)  # as `_keep_frontend` does once it has exited
        tree._spawn_frontend(0)
        tree._tell_engine_frontend_gone(PID)
        for _ in range(1000):  # bounded: 10 s for the loop to hear both pipes' EOF
            if len(closed) == 2:
                break
            await asyncio.sleep(0.01)
    finally:
        tree._zmq.destroy(linger=0)
    first, second = spawner.tokens
    assert first != second
    assert notices == [FrontEndGone(PID, first), FrontEndGone(PID, second)]
