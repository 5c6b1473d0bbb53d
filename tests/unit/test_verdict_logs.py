"""Liveness, readiness and the engine's batch health are logged once per change of verdict
(`app/log_limits.py::VerdictLog`): they were computed into probe bodies only, so a pod that
turned unhealthy (a crash loop, an engine that cannot be killed, batches failing, a lost
device) and was restarted for it left no line in any log saying why. A verdict answered
again, or whose counts alone grew, adds nothing."""

from __future__ import annotations

import logging

import msgspec
import pytest

from app.crash_loop import RESTARTS_BEFORE_UNHEALTHY
from app.engine.health import BatchHealth
from app.engine.protocol import EngineStatus
from app.log_limits import VerdictLog
from app.probes import ProbeVerdicts, probe_response, readiness
from app.processes import ProcessTree
from tests.support.process_tree import StandIn, hear, ready_status


def said(caplog: pytest.LogCaptureFixture, logger: str) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == logger]


def test_a_verdict_is_logged_when_it_changes_its_counts_aside(
    caplog: pytest.LogCaptureFixture,
) -> None:
    verdicts = VerdictLog(logging.getLogger("verdicts"), "liveness", assumed="ok")
    with caplog.at_level(logging.INFO, logger="verdicts"):
        verdicts.note("ok")
        verdicts.note("unhealthy", "the engine restarted 5 times without becoming ready")
        verdicts.note("unhealthy", "the engine restarted 6 times without becoming ready")
        verdicts.note("unhealthy", "engine 12 still runs 10 s after it was killed")
        verdicts.note("unhealthy", "engine 12 still runs 11.5 s after it was killed")
        verdicts.note("ok")
        verdicts.note("ok")
    assert said(caplog, "verdicts") == [
        ("WARNING", "liveness: unhealthy (the engine restarted 5 times without becoming ready)"),
        ("WARNING", "liveness: unhealthy (engine 12 still runs 10 s after it was killed)"),
        ("INFO", "liveness: ok"),
    ]


def _engine(state: str = "ready") -> EngineStatus:
    return msgspec.structs.replace(ready_status(42), state=state)


def test_each_probe_answer_logs_the_verdicts_that_changed(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A front end's /healthz and /readyz, the in-process probe port and the supervisor's
    all answer through `probe_response`."""
    monkeypatch.setattr("app.probes.PROBE_VERDICTS", ProbeVerdicts())
    warming = readiness(_engine("warming_up"), None, False, True)
    ready = readiness(_engine(), None, False, True)
    failing = "model 'm': 5 consecutive batches failed (RuntimeError)"
    with caplog.at_level(logging.INFO, logger="app.probes"):
        for _ in range(3):
            probe_response("/readyz", warming, None)
        probe_response("/healthz", ready, None)
        probe_response("/readyz", ready, None)
        probe_response("/healthz", ready, failing)
        probe_response("/healthz", ready, failing.replace("5", "6"))
        probe_response("/healthz", ready, None)
    assert said(caplog, "app.probes") == [
        ("INFO", "readiness: warming_up"),
        ("INFO", "readiness: ready"),
        ("WARNING", f"liveness: unhealthy ({failing})"),
        ("INFO", "liveness: ok"),
    ]


async def test_the_supervisor_logs_a_crash_loop_once(
    tree: ProcessTree, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("app.probes.PROBE_VERDICTS", ProbeVerdicts())
    tree.engine.process = StandIn(111)  # type: ignore[assignment]
    hear(tree, ready_status(111))
    tree._engine_status.forget()
    tree.engine.restarts += RESTARTS_BEFORE_UNHEALTHY
    with caplog.at_level(logging.INFO, logger="app.probes"):
        for _ in range(3):
            tree._answer_probe("/healthz")
        tree.engine.restarts += 1
        tree._answer_probe("/readyz")
    warnings = [m for level, m in said(caplog, "app.probes") if level == "WARNING"]
    assert warnings[0] == (
        "liveness: unhealthy (the engine restarted 5 times without becoming ready)"
    )
    assert [m for m in warnings if m.startswith("liveness")] == warnings[:1]


def test_the_engine_logs_each_flip_of_its_batch_health(caplog: pytest.LogCaptureFixture) -> None:
    health = BatchHealth(threshold=2)
    with caplog.at_level(logging.INFO, logger="app.engine.health"):
        health.record(None, "m")  # healthy all along: nothing to say
        health.record(RuntimeError("a fault"), "m")  # one: under the threshold
        health.record(RuntimeError("a fault"), "m")
        health.record(RuntimeError("a fault"), "m")
        health.record(None, "other")
        health.record(None, "m")
        health.record(None, "m")
    assert said(caplog, "app.engine.health") == [
        (
            "WARNING",
            "engine health: unhealthy (model 'm': 2 consecutive batches failed (RuntimeError))",
        ),
        ("INFO", "engine health: healthy"),
    ]
