"""The probe sampler (app/telemetry/background.py): its schedule, and its thread's life,
which a process's telemetry starts, stops and joins. Fake probes stand in for NVML; the GPU
probes themselves are tests/unit/test_gpu_probes.py's."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping

import pytest

from app.drain import ENGINE_STOP_S
from app.metrics import Metrics
from app.telemetry.background import SAMPLER_THREAD_NAME, BackgroundProbe, ProbeSampler
from app.telemetry.sampler import ProcessTelemetry


class Counting(BackgroundProbe):
    def __init__(self, every_s: float, fail: bool = False) -> None:
        super().__init__()
        self.sample_every_s = every_s
        self.samples = 0
        self.fail = fail

    def sample(self) -> Mapping[str, float]:
        self.samples += 1
        if self.fail:
            raise RuntimeError("driver bug")
        return {"samples_total": float(self.samples)}


def test_the_sampler_samples_each_probe_when_due_and_survives_a_failing_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fast, slow, broken = Counting(0.05), Counting(1.0), Counting(0.05, fail=True)
    sampler = ProbeSampler([fast, slow, broken])
    with caplog.at_level(logging.WARNING, logger="app.telemetry.background"):
        assert sampler.run_due(0.0) == pytest.approx(0.05)
        assert sampler.run_due(0.05) == pytest.approx(0.1)
        sampler.run_due(0.07)  # nothing due
    assert (fast.samples, slow.samples, broken.samples) == (2, 1, 2)
    assert fast.read() == {"samples_total": 2.0} and slow.read() == {"samples_total": 1.0}
    assert broken.read() == {}
    assert len(caplog.records) == 1  # a failing probe is logged once, not every 50 ms


def test_a_process_without_slow_probes_starts_no_sampler_thread() -> None:
    telemetry = ProcessTelemetry("frontend", Metrics(), [])
    telemetry.start()
    assert SAMPLER_THREAD_NAME not in {thread.name for thread in threading.enumerate()}


class Held(BackgroundProbe):
    """A probe whose sample lasts until the test lets it go, as a slow driver call does."""

    def __init__(self) -> None:
        super().__init__()
        self.sampling = threading.Event()
        self.let_go = threading.Event()

    def sample(self) -> Mapping[str, float]:
        self.sampling.set()
        self.let_go.wait(timeout=60)
        return {"held_total": 1.0}


def sampler_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == SAMPLER_THREAD_NAME]


async def test_stopping_a_process_telemetry_waits_for_its_sampler_thread_to_end() -> None:
    """The stop only asked the thread to end: the engine process went on to exit with it
    still inside a sample, and a daemon thread calling NVML while the interpreter shuts
    down can crash the process on its way out."""
    held = Held()
    telemetry = ProcessTelemetry("engine", Metrics(), [held])
    telemetry.start()
    try:
        assert await asyncio.to_thread(held.sampling.wait, 30)
        # The sample ends only once the stop has given the loop a turn: a stop that does
        # not wait for the thread returns while it is still sampling.
        asyncio.get_running_loop().call_soon(held.let_go.set)
        await telemetry.stop()
        assert sampler_threads() == []
        assert not telemetry.sampler.running
    finally:
        held.let_go.set()


async def test_a_sample_hanging_past_the_join_timeout_is_logged_and_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A driver call hanging on a failing GPU must not hold up the process's exit for
    ever: the stop waits `join_timeout_s`, says so, and goes on."""
    held = Held()
    telemetry = ProcessTelemetry("engine", Metrics(), [held])
    telemetry.sampler.join_timeout_s = 0.05
    telemetry.start()
    try:
        assert await asyncio.to_thread(held.sampling.wait, 30)
        with caplog.at_level(logging.WARNING, logger="app.telemetry.background"):
            await telemetry.stop()
        assert "still sampling 0.05 s after it was stopped" in caplog.text
        assert telemetry.sampler.running  # still inside its sample
    finally:
        held.let_go.set()
    telemetry.sampler.join_timeout_s = 30
    assert await asyncio.to_thread(telemetry.sampler.join)
    assert sampler_threads() == []


def test_a_hanging_sample_leaves_the_engine_most_of_its_stop_budget() -> None:
    """The engine's stop (finishing its batches, the sampler's join, the dispatcher's
    shutdown) has `ENGINE_STOP_S` before the supervisor kills it: a join waiting longer
    would have it killed mid-stop whenever a driver call hangs."""
    assert ProbeSampler([]).join_timeout_s <= ENGINE_STOP_S / 4
