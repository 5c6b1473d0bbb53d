"""Spikes caused on purpose against a running server (the ASGI app with an in-process
engine), each answered by a slow-request report whose top cause names it; and a request
that was not slow leaves no report. GPU throttling, allocator retries and CUDA context
changes come through fake probes (this machine has no GPU); the rest are real: a GC pause,
a blocked event loop, queueing behind a burst, a shape warm-up left out. CPU contention
from a competing process is in `tests/e2e/test_spikes_e2e.py`."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from app.engine.core import EngineCore
from app.engine.inprocess import InProcessEngine
from app.main import create_app
from app.model_specs import ModelSpec
from app.settings import Settings
from app.telemetry.probe import FakeProbe
from tests.support.asgi import serving
from tests.support.fake_model import GatedLoader, GatedRunner
from tests.support.scheduling import hold_the_worker

TOKEN = "spike-test-token"
BASE: dict[str, object] = {
    "engine": "inprocess",
    "models": (ModelSpec(name="fake"),),
    "length_buckets": (8, 16, 64),
    "max_batch_size": 4,
    "max_wait_ms": 0.0,
    "dispatcher_threads": 1,
    "debug_token": TOKEN,
    "slow_request_ms": 60.0,
    # The point is the report, not admission: nothing here may be refused for delay.
    "max_queue_delay_ms": 60_000.0,
}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Server:
    client: httpx.AsyncClient
    runner: GatedRunner
    engine: EngineCore

    async def reports(self) -> list[dict[str, Any]]:
        response = await self.client.get("/debug/slow", headers=AUTH)
        assert response.status_code == 200, response.text
        reports: list[dict[str, Any]] = response.json()["reports"]
        return reports

    async def only_report(self) -> dict[str, Any]:
        reports = await self.reports()
        assert len(reports) == 1, [r["causes"] for r in reports]
        return reports[0]

    async def slow_counter(self, cause: str) -> float:
        text = (await self.client.get("/metrics")).text
        prefix = f'steadyserve_slow_requests_total{{cause="{cause}"}} '
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)]
        return sum(values)

    async def hold_the_worker(self) -> asyncio.Task[httpx.Response]:
        """Start a request whose batch blocks in the model until `runner.gate` is set."""
        return await hold_the_worker(self.runner, self.client)

    async def while_in_the_model(self, spike: Any, texts: str = "one two") -> httpx.Response:
        """Send a request; while its batch is in the model (held at the gate), run
        `spike()` on the event loop; then let the batch finish and return the answer."""
        self.runner.gate.clear()
        request = asyncio.create_task(self.client.post("/infer", json={"inputs": texts}))
        started = await asyncio.to_thread(self.runner.started.acquire, True, 30)
        assert started, "the request's batch never reached the model"
        try:
            spike()
        finally:
            self.runner.gate.set()
        return await request


@contextlib.asynccontextmanager
async def running(**overrides: object) -> AsyncIterator[Server]:
    loader = GatedLoader()
    app = create_app(
        Settings(**{**BASE, **overrides}),  # type: ignore[arg-type]
        loader=loader,
        tokenizer_loader=loader.tokenizer,
    )
    async with serving(app) as client:
        runner = loader.runners["fake"]
        runner.started = type(runner.started)(0)  # forget warm-up's batches
        engine = app.state.service.engine
        assert isinstance(engine, InProcessEngine)
        yield Server(client, runner, engine.core)


async def until(condition: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    """Poll `condition` on the loop until it holds; fail after `within_s` (a bound on a
    hang, not on timing)."""
    give_up_at = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < give_up_at, f"never happened: {what}"
        await asyncio.sleep(0.001)  # polling interval: the condition is re-checked


def top(report: dict[str, Any]) -> tuple[str, str]:
    cause = report["causes"][0]
    return cause["cause"], cause["evidence"]


async def test_a_request_that_was_not_slow_produces_no_report() -> None:
    async with running(slow_request_ms=1000.0) as server:
        response = await server.client.post("/infer", json={"inputs": "fast"})
        assert response.status_code == 200
        assert await server.reports() == []
        # The same server reports a request over its threshold.
        server.runner.busy_s = 1.1
        assert (await server.client.post("/infer", json={"inputs": "slow"})).status_code == 200
        assert len(await server.reports()) == 1


async def test_gc_pause_is_the_top_cause() -> None:
    async with running() as server:
        # Enough live container objects that a full collection takes well over 60 ms.
        garbage = [[index] for index in range(3_000_000)]
        pause_started = time.perf_counter()

        def full_collection() -> None:
            gc.collect()

        response = await server.while_in_the_model(full_collection)
        paused = time.perf_counter() - pause_started
        del garbage
        assert response.status_code == 200
        report = await server.only_report()
        cause, evidence = top(report)
        assert cause == "gc_pause", report["causes"]
        assert "GC gen-2 pause" in evidence and "front end" in evidence
        assert report["causes"][0]["ms"] <= paused * 1000
        assert await server.slow_counter("gc_pause") == 1


async def test_blocked_event_loop_is_the_top_cause() -> None:
    async with running() as server:

        def block_the_loop() -> None:
            time.sleep(0.25)  # the bug under test: blocking code on the event loop

        response = await server.while_in_the_model(block_the_loop)
        assert response.status_code == 200
        report = await server.only_report()
        cause, evidence = top(report)
        assert cause == "event_loop_blocked", report["causes"]
        assert "event loop was blocked" in evidence
        assert report["causes"][0]["ms"] >= 100


async def test_queueing_behind_a_burst_is_the_top_cause() -> None:
    """Ten requests of 4 inputs queue behind a batch held in the model (all of them, however
    slow the front end is to pass them on: a race of the front end against 30 ms batches
    left the queue shallow on a slowed loop), then run as ten 100 ms batches in a row.
    The batches sleep: queueing grows with them, the event loop's work (what CPU
    contention on a shared machine delays, and is rightly named for) does not."""
    async with running(slow_request_ms=150.0) as server:
        server.runner.busy_s = 0.1  # every batch (4 inputs at most) takes 100 ms
        held = await server.hold_the_worker()
        burst = [
            asyncio.create_task(
                server.client.post("/infer", json={"inputs": ["a b", "c d", "e f", "g h"]})
            )
            for _ in range(10)
        ]
        scheduler = server.engine.hosts["fake"].batcher.scheduler
        await until(lambda: scheduler.depth == 40, "the burst's 40 inputs queued")
        server.runner.gate.set()
        responses = await asyncio.gather(held, *burst)
        assert all(r.status_code == 200 for r in responses)
        reports = await server.reports()
        assert reports, "the last of ten 100 ms batches in a row waited 1+ s"
        # The one that arrived behind the most inputs (the other nine's), and most of the
        # others (on a shared machine one may have lost more to another process).
        deepest = max(reports, key=lambda r: r["queue_depth_at_arrival"])
        assert deepest["queue_depth_at_arrival"] == 36, [r["causes"][:2] for r in reports]
        cause, evidence = top(deepest)
        assert cause == "queueing", deepest["causes"]
        assert "behind 36 inputs" in evidence
        queued = [r for r in reports if top(r)[0] == "queueing"]
        assert len(queued) * 2 > len(reports), [r["causes"][:2] for r in reports]


async def test_shape_left_out_of_warm_up_is_the_top_cause() -> None:
    async with running(warmup=False, slow_request_ms=50.0) as server:
        server.runner.busy_s = 0.1  # set-up on first use of a shape
        response = await server.client.post("/infer", json={"inputs": "a b c"})
        assert response.status_code == 200
        report = await server.only_report()
        cause, evidence = top(report)
        assert cause == "unwarmed_shape", report["causes"]
        assert "(1, 8) was not warmed up" in evidence
        assert report["batch"]["first_seen_shape"] is True


@pytest.mark.parametrize(
    ("levels", "counters", "cause", "evidence"),
    [
        (
            {
                "gpu_sm_clock_hertz": 810e6,
                "gpu_sm_clock_max_hertz": 1980e6,
                "gpu_throttle_reasons": 0x20 | 0x40,
            },
            {},
            "gpu_throttled",
            "GPU SM clock 810 MHz of 1980, software thermal, hardware thermal",
        ),
        ({}, {"cuda_alloc_retries_total": 3}, "allocator_retry", "allocator retried 3 times"),
        (
            {},
            {"cuda_context_changes_total": 1},
            "cuda_context_change",
            "new CUDA context current",
        ),
    ],
)
async def test_device_spikes_through_fake_probes(
    levels: dict[str, float], counters: dict[str, float], cause: str, evidence: str
) -> None:
    async with running() as server:
        device = FakeProbe({"cuda_alloc_retries_total": 0, "cuda_context_changes_total": 0})
        device.set(**levels)
        server.engine.telemetry.probes.probes.append(device)
        server.runner.busy_s = 0.1  # the batch runs slowly on the (fake) troubled device

        def device_trouble() -> None:
            device.add(**counters)

        response = await server.while_in_the_model(device_trouble)
        assert response.status_code == 200
        report = await server.only_report()
        assert top(report)[0] == cause, report["causes"]
        assert evidence in top(report)[1]
        assert await server.slow_counter(cause) == 1


async def test_debug_slow_needs_the_token() -> None:
    async with running() as server:
        assert (await server.client.get("/debug/slow")).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (await server.client.get("/debug/slow", headers=wrong)).status_code == 401
    async with running(debug_token=None) as server:
        assert (await server.client.get("/debug/slow")).status_code == 404
