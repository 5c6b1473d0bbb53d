"""While the engine restarts, `/readyz` says why the last engine was lost (killed as stuck,
a signal, an exit status) and which restart is under way, on the supervisor's probe port and
on a front end's alike, until a new engine is ready. The supervisor's restart loop runs for
real, with stand-in engines on the tree's injected clock; the front end hears it over the
supervisor's socket."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from app.engine.protocol import EngineStatus
from app.engine.zmq_client import EngineAddresses, ZmqEngineClient
from app.metrics import Metrics
from app.model_specs import ModelSpec
from app.probes import READYZ, probe_response
from app.processes import ProcessTree
from app.service import Service
from app.settings import Settings
from tests.support.manual_clock import ManualClock
from tests.support.process_tree import StandIn, ready_status

STUCK_COMPUTE_S = 45.0


class Engine(StandIn):
    """A stand-in engine whose exit the supervisor's `wait_for_exit` awaits."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self.exited = asyncio.Event()

    def kill(self) -> None:
        super().kill()
        self.die(-signal.SIGKILL)

    def die(self, exitcode: int) -> None:
        self.alive, self.exitcode = False, exitcode
        self.exited.set()


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within 5 s: {what}")


def said(tree: ProcessTree, pid: int, state: str, oldest_compute_s: float = 0.0) -> None:
    status: EngineStatus = msgspec.structs.replace(
        ready_status(pid), state=state, oldest_compute_s=oldest_compute_s
    )
    tree._engine_status.take(status)


@pytest.fixture
async def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ProcessTree]:
    settings = Settings(
        stuck_compute_s=STUCK_COMPUTE_S,
        max_timeout_ms=1000 * STUCK_COMPUTE_S,
        engine_restart_backoff_s=(0.001, 0.004),
    )
    tree = ProcessTree(settings, tmp_path, clock=ManualClock(1000.0))
    tree.frontends = [StandIn(10)]  # type: ignore[list-item]
    tree._heartbeats.started(0)
    engines = iter([Engine(501), Engine(502), Engine(503)])

    def spawn() -> Engine:
        engine = next(engines, None)
        if engine is None:
            raise asyncio.CancelledError  # no fourth engine: the supervisor's loop ends
        return engine

    async def wait_for_exit(process: Engine) -> None:
        await process.exited.wait()

    monkeypatch.setattr(tree.engine, "_spawn", spawn)
    monkeypatch.setattr("app.engine.supervisor.wait_for_exit", wait_for_exit)
    yield tree
    if tree.engine.process is not None:  # a stand-in: `stop` must send no real pid a signal
        tree.engine.process.alive = False  # type: ignore[attr-defined]
    await tree.engine.stop()
    tree._zmq.destroy(linger=0)


async def frontend(settings: Settings, addresses: EngineAddresses) -> Service:
    def no_tokenizer(spec: ModelSpec, largest: int) -> Any:
        return object()

    service = Service(settings, Metrics(), ZmqEngineClient(addresses), no_tokenizer)
    await service.start()
    return service


def running(tree: ProcessTree) -> int | None:
    process = tree.engine.process
    return process.pid if process is not None and process.is_alive() else None


def readyz(tree: ProcessTree) -> tuple[int, dict[str, Any]]:
    status, body = tree._answer_probe(READYZ)
    return status, json.loads(body)


def frontend_readyz(service: Service) -> tuple[int, dict[str, Any]]:
    status, body = probe_response(READYZ, service.readiness(), service.liveness())
    return status, json.loads(body)


async def test_readyz_says_why_the_last_engine_was_lost_until_a_new_one_is_ready(
    tree: ProcessTree,
) -> None:
    """Said only "no engine is connected (restarting?)": why it was lost (a stuck compute
    killed, a SIGKILL, an exit status) was in the supervisor's log alone."""
    service = await frontend(tree.settings, tree.addresses)
    try:
        tree.engine.start()
        await until(lambda: tree.engine.process is not None, "the first engine spawned")
        said(tree, 501, "ready", oldest_compute_s=STUCK_COMPUTE_S + 30)
        tree._check_engine()  # a wedged GPU: killed, then restarted
        await until(lambda: running(tree) == 502, "engine 501 replaced")
        killed = (
            "engine 501 killed: it has had a compute running for 75 s, still not returned "
            "(STEADY_STUCK_COMPUTE_S=45); restart 1 under way (after a 0.001 s back-off)"
        )
        assert readyz(tree) == (503, {
            "status": "engine_unavailable", "problem": killed, "warmup": {"done": 0, "total": 0},
        })  # fmt: skip
        # The front end hears it from the supervisor and says the same.
        await until(lambda: frontend_readyz(service) == readyz(tree), "the front end agrees")

        said(tree, 502, "warming_up")  # the replacement warms up: the reason stays
        assert readyz(tree)[1]["problem"] == killed
        said(tree, 502, "ready")  # ready: the reason is cleared
        assert readyz(tree) == (200, {
            "status": "ready", "warmup": {"done": 3, "total": 3}, "engine": {"pid": 502},
        })  # fmt: skip
        await until(lambda: service.engine.restart_under_way() is None, "the front end clears")

        tree._clock.now += 61  # type: ignore[attr-defined]  # ready a minute: backoff reset
        tree.engine.process.die(-signal.SIGKILL)  # type: ignore[union-attr]
        await until(lambda: running(tree) == 503, "engine 502 replaced")
        assert readyz(tree)[1]["problem"] == (
            "engine 502 exited by signal SIGKILL; restart 1 under way (after a 0.001 s back-off)"
        )
        await until(lambda: frontend_readyz(service) == readyz(tree), "the front end agrees")

        tree.engine.process.die(1)  # type: ignore[union-attr]  # 503, before it was ready
        await until(lambda: tree.engine._task is not None and tree.engine._task.done(), "503")
        assert readyz(tree)[1]["problem"] == (
            "engine 503 exited with code 1; restart 2 under way (after a 0.002 s back-off)"
        )
        await until(lambda: frontend_readyz(service) == readyz(tree), "the front end agrees")
    finally:
        await service.engine.close()


def test_the_loss_reason_names_the_signal_or_the_exit_status() -> None:
    from app.engine.supervisor import loss_reason  # here: the test above fails on its own

    assert loss_reason(7, -signal.SIGSEGV, None) == "engine 7 exited by signal SIGSEGV"
    assert loss_reason(7, 3, None).startswith("engine 7 exited with code 3 (a sticky CUDA")
    assert loss_reason(7, -9, "is stuck") == "engine 7 killed: it is stuck"


async def test_a_ready_status_the_dead_engine_left_queued_does_not_end_its_restart(
    tree: ProcessTree,
) -> None:
    """The engine published "ready" every few milliseconds before it died, and one still
    queued may be read after its death was (an app that supervises its own engine forgets
    no status at the exit): it ended the restart under way, /readyz said nothing of why
    through the back-off and reload, and the next restart counted from 1 again."""
    dead = Engine(501)
    tree.engine.process = dead  # type: ignore[assignment]
    dead.die(-signal.SIGKILL)
    tree.engine._restarting("engine 501 exited by signal SIGKILL", 1.0)
    tree.engine.saw_ready(501)  # its last word, read late
    assert tree.engine.restart is not None
    assert tree.engine.restarts_since_ready == 1
