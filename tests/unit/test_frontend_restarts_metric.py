"""`steadyserve_frontend_restarts_total{reason}`: the supervisor tells each front end it
starts why the one it replaces ended (`hung`: killed for its silence, `died`: anything else,
nothing for a first start), and the replacement counts itself at its start, as the engine
counts its own restarts (a counter outlives its process in multiprocess mode). The
supervisor restarted front ends that died or hung, and no metric showed it."""

from __future__ import annotations

import multiprocessing
from collections.abc import AsyncIterator
from inspect import signature
from pathlib import Path

import pytest

from app.frontend_heartbeats import SILENT_AFTER_S
from app.frontend_process import run_frontend_process
from app.main import create_app
from app.metrics import FRONTEND_RESTART_REASONS
from app.processes import ProcessTree
from app.settings import Settings
from loadtest.null_engine import NullEngine
from tests.support.manual_clock import ManualClock
from tests.support.process_tree import StandIn

RESTARTS = "steadyserve_frontend_restarts_total"


class RecordingContext:
    """The spawn context, but its processes start nothing: each records its arguments."""

    def __init__(self) -> None:
        self.Pipe = multiprocessing.get_context("spawn").Pipe
        self.args: list[tuple[object, ...]] = []

    def Process(self, target: object, args: tuple[object, ...], name: str) -> StandIn:
        self.args.append(args)

        class Child(StandIn):
            def start(self) -> None:
                pass

        return Child(500 + len(self.args))


@pytest.fixture
async def tree(tmp_path: Path) -> AsyncIterator[tuple[ProcessTree, RecordingContext]]:
    tree = ProcessTree(Settings(), tmp_path, clock=ManualClock(1000.0))
    context = RecordingContext()
    tree._context = context  # type: ignore[assignment]
    yield tree, context
    tree._zmq.destroy(linger=0)


async def test_each_front_end_is_told_why_the_one_it_replaces_ended(
    tree: tuple[ProcessTree, RecordingContext],
) -> None:
    processes, context = tree
    processes._spawn_frontend(0)  # its first start
    processes._heartbeats.started(0)
    processes._clock.now += SILENT_AFTER_S + 1  # type: ignore[attr-defined]
    processes._check_frontends()  # silent: killed as hung
    assert processes.frontends[0].killed  # type: ignore[attr-defined]
    processes._spawn_frontend(0)  # its replacement
    processes._spawn_frontend(0)  # that one died on its own (a failed start-up, a crash)
    told = [signature(run_frontend_process).bind(*args).arguments for args in context.args]
    assert [arguments["replacing"] for arguments in told] == [None, "hung", "died"]


@pytest.mark.parametrize("replacing", [None, "died", "hung"])
def test_a_replacement_front_end_counts_its_restart_at_its_start(replacing: str | None) -> None:
    settings = Settings()
    app = create_app(settings, engine=NullEngine(settings), replacing=replacing)
    registry = app.state.service.metrics.registry
    counted = {
        reason: registry.get_sample_value(RESTARTS, {"reason": reason})
        for reason in FRONTEND_RESTART_REASONS
    }
    # Both series exist from the start (a first restart is an increase), at 0 but the one.
    assert counted == {reason: float(reason == replacing) for reason in FRONTEND_RESTART_REASONS}
