"""Scheduling behaviour through the ASGI app with an in-process engine and a gated fake
model, so each test decides when a batch finishes (the point here is the queue, not the
numbers; the engine process runs the real model in `test_embeddings.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI

from app.admission import RejectReason
from app.api.cancellation import ClientDisconnected, run_until_disconnect
from app.api.errors import RETRY_ELSEWHERE_HEADER
from app.embedding_service import embed_texts
from app.engine.core import EngineCore
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import EmbedPayload, Submit
from app.main import create_app
from app.model_specs import ModelSpec
from app.scheduler import BatchShape
from app.service import Service
from app.settings import Settings
from app.timing import PhaseTimer
from tests.support.asgi import serving
from tests.support.fake_model import GatedLoader, GatedRunner

BASE = {
    "engine": "inprocess",
    "models": (ModelSpec(name="fake"),),
    "length_buckets": (8, 16, 64),
    "max_batch_size": 4,
    "max_wait_ms": 0.0,
    "dispatcher_threads": 1,  # one worker, so holding it holds every batch
}


@dataclass
class Harness:
    client: httpx.AsyncClient
    service: Service
    runner: GatedRunner

    def runner_of(self, model: str) -> GatedRunner:
        runner = self.engine.hosts[model].batcher.runner
        assert isinstance(runner, GatedRunner)
        return runner

    @property
    def engine(self) -> EngineCore:
        engine = self.service.engine
        assert isinstance(engine, InProcessEngine)
        return engine.core

    async def hold_the_worker(self) -> asyncio.Task[httpx.Response]:
        """Start a request whose batch blocks in the model until `release()`."""
        self.runner.gate.clear()
        task = asyncio.create_task(self.client.post("/infer", json={"inputs": "hold"}))
        started = await asyncio.to_thread(self.runner.started.acquire, True, 30)
        assert started, "the held request's batch never reached the model"
        return task

    def release(self) -> None:
        self.runner.gate.set()

    async def queue_then_release(self, texts: list[str]) -> list[httpx.Response]:
        """While the worker is held, queue one unnormalised request per text; once all are
        queued, release the worker and return the answers in order."""
        waiting = [
            asyncio.create_task(
                self.client.post("/infer", json={"inputs": t, "parameters": {"normalize": False}})
            )
            for t in texts
        ]
        scheduler = self.engine.hosts["fake"].batcher.scheduler
        await self.until(lambda: scheduler.depth == len(texts), "all queued")
        self.release()
        return [await task for task in waiting]

    async def until(self, condition: object, what: str) -> None:
        for _ in range(10_000):
            if callable(condition) and condition():
                return
            await asyncio.sleep(0)  # yield to the loop; the condition is re-checked
        raise AssertionError(f"never happened: {what}")


@contextlib.asynccontextmanager
async def start(
    prepare: Callable[[FastAPI], None] | None = None, **overrides: object
) -> AsyncIterator[Harness]:
    """The harness, on settings `BASE` with `overrides`; `prepare` may change the app
    before it serves (its middleware is built on the first request)."""
    loader = GatedLoader()
    settings = Settings(**{**BASE, **overrides})  # type: ignore[arg-type]
    app = create_app(settings, loader=loader, tokenizer_loader=loader.tokenizer)
    if prepare is not None:
        prepare(app)
    async with serving(app) as client:
        runner = loader.runners["fake"]
        runner.started = type(runner.started)(0)  # forget warm-up's batches
        runner.batches.clear()
        yield Harness(client, app.state.service, runner)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    async with start() as h:
        yield h


async def test_readyz_reports_warmup_progress_until_every_shape_ran() -> None:
    loader = GatedLoader()
    loader.loaded.clear()
    app = create_app(
        Settings(**BASE),  # type: ignore[arg-type]
        loader=loader,
        tokenizer_loader=loader.tokenizer,
    )
    async with serving(app, wait_ready=False) as client:
        waiting = await client.get("/readyz")
        assert waiting.status_code == 503
        assert waiting.json() == {
            "status": "loading",
            "warmup": {"done": 0, "total": 0},
            "engine": {"pid": os.getpid()},  # in-process
        }
        early = await client.post("/infer", json={"inputs": "too early"})
        assert early.status_code == 503
        assert early.json()["error"]["type"] == "not_ready"
        assert (await client.get("/healthz")).status_code == 200
        loader.loaded.set()
        await app.state.startup_task
        await app.state.service.engine.wait_ready()
        ready = await client.get("/readyz")
        total = len(app.state.service.engine.core.hosts["fake"].batcher.scheduler.policy.shapes())
        assert ready.status_code == 200
        assert ready.json()["warmup"] == {"done": total, "total": total}
        metrics = (await client.get("/metrics")).text
        assert f'steadyserve_warmup_shapes_done{{model="fake"}} {total}.0' in metrics


async def test_warm_up_estimates_each_shape_from_a_warm_run() -> None:
    """A shape's first run pays its set-up: an estimate seeded from it (the EWMA's first
    value) refused or expired requests that would have fitted, until traffic measured the
    shape again."""
    loader = GatedLoader(cold_s=0.2)
    app = create_app(Settings(**BASE), loader=loader, tokenizer_loader=loader.tokenizer)  # type: ignore[arg-type]
    async with serving(app):
        scheduler = app.state.service.engine.core.hosts["fake"].batcher.scheduler
        estimates = [scheduler.estimated_compute(s) for s in scheduler.policy.shapes()]
    # A cold run takes 0.2 s at least; the fake's warm runs take ~nothing. Under half the
    # cold run: an estimate smoothed from the cold run and then a warm one is 0.16 s.
    assert max(estimates) < 0.1, estimates


async def test_a_request_whose_deadline_passes_in_the_queue_gets_504_uncomputed(
    harness: Harness,
) -> None:
    holder = await harness.hold_the_worker()
    sending = asyncio.create_task(
        harness.client.post("/infer", json={"inputs": "never run", "timeout_ms": 30})
    )
    # Admitted and queued first: this 504 is queue expiry, not a refusal at admission.
    scheduler = harness.engine.hosts["fake"].batcher.scheduler
    await harness.until(lambda: scheduler.depth == 1 or sending.done(), "the request is queued")
    assert scheduler.depth == 1, (await sending).json()
    late = await sending
    assert late.status_code == 504
    assert late.json()["error"] == {
        "type": "deadline",
        "message": "deadline passed in the queue",  # where it passed, as the engine said
        "param": None,
        "code": "deadline",
    }
    assert "tokenize;" in late.headers["server-timing"]
    # Answered at its deadline, while the worker is still busy, not when it frees up.
    pool = harness.engine.hosts["fake"].batcher.pool
    assert sum(pool.stats().in_use.values()) == 1
    harness.release()
    assert (await holder).status_code == 200
    computed = [row for batch in harness.runner.batches for row in batch]
    assert [1, 5, 3, 2] not in computed  # "never run" is never computed
    assert harness.engine.queued_inputs() == 0
    assert harness.service.admission.inflight == 0


async def test_a_cancelled_request_leaves_the_queue_before_it_is_computed(
    harness: Harness,
) -> None:
    holder = await harness.hold_the_worker()
    timer = PhaseTimer()
    abandoned = asyncio.create_task(
        embed_texts(
            harness.service, "fake", ["abandoned words"], normalize=False, truncate=False,
            timeout_ms=None, envoy_timeout_ms=None, timer=timer,
        )
    )  # fmt: skip
    batcher = harness.engine.hosts["fake"].batcher
    await harness.until(lambda: batcher.scheduler.depth == 1, "the request is queued")
    abandoned.cancel()
    await harness.until(lambda: harness.engine.queued_inputs() == 0, "the queue drops it")
    harness.release()
    assert (await holder).status_code == 200
    computed = [row for batch in harness.runner.batches for row in batch]
    assert [1, 9, 5, 2] not in computed
    assert harness.service.admission.inflight == 0


async def test_a_cancel_read_in_the_same_turn_as_its_submit_drops_the_rows(
    harness: Harness,
) -> None:
    """Its task is cancelled before it ever runs (`gather_rows` never starts): the rows
    used to stay queued and be computed for nobody."""
    holder = await harness.hold_the_worker()
    core = harness.engine
    request = Submit(999, "fake", 1e12, EmbedPayload([[1, 5, 2]]))
    core.submit(b"front", request, lambda message: None)
    scheduler = core.hosts["fake"].batcher.scheduler
    assert scheduler.depth == 1
    core.cancel(b"front", request.request_id)  # same turn: its task has not run
    await harness.until(lambda: core.queued_inputs() == 0, "the cancelled rows dropped")
    harness.release()
    assert (await holder).status_code == 200
    computed = [row for batch in harness.runner.batches for row in batch]
    assert [1, 5, 2] not in computed


async def test_a_client_disconnect_cancels_the_work() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def work() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "unreachable"

    class DisconnectingRequest:
        async def receive(self) -> dict[str, str]:
            await started.wait()
            return {"type": "http.disconnect"}

    with pytest.raises(ClientDisconnected):
        await run_until_disconnect(DisconnectingRequest(), work())  # type: ignore[arg-type]
    assert cancelled.is_set()


async def test_inflight_cap_answers_429_with_retry_after() -> None:
    async with start(max_inflight=1) as harness:
        holder = await harness.hold_the_worker()
        rejected = await harness.client.post("/infer", json={"inputs": "one too many"})
        assert rejected.status_code == 429
        assert rejected.json()["error"]["type"] == RejectReason.INFLIGHT.value
        assert int(rejected.headers["retry-after"]) >= 1
        assert rejected.headers[RETRY_ELSEWHERE_HEADER] == "1"  # it did no work here
        harness.release()
        assert (await holder).status_code == 200
        metrics = (await harness.client.get("/metrics")).text
        # Refused from its headers, before its body (and so its model) was read.
        assert 'steadyserve_rejected_total{model="",reason="inflight"} 1.0' in metrics


async def test_queue_cap_answers_429_and_reports_depth() -> None:
    async with start(max_queue=3, max_inputs_per_request=3) as harness:
        holder = await harness.hold_the_worker()
        queued = asyncio.create_task(
            harness.client.post("/infer", json={"inputs": ["a b", "c d e", "f"]})
        )
        await harness.until(lambda: harness.engine.queued_inputs() == 3, "3 inputs queued")
        rejected = await harness.client.post("/infer", json={"inputs": "no room"})
        assert rejected.status_code == 429
        assert rejected.json()["error"]["type"] == "queue"
        assert "retry-after" in rejected.headers
        assert rejected.headers[RETRY_ELSEWHERE_HEADER] == "1"
        metrics = (await harness.client.get("/metrics")).text
        assert "steadyserve_queue_depth 3.0" in metrics
        assert "steadyserve_queue_depth_max 3.0" in metrics
        harness.release()
        assert (await holder).status_code == 200
        assert (await queued).status_code == 200


async def test_waiting_requests_are_batched_together(harness: Harness) -> None:
    holder = await harness.hold_the_worker()
    texts = ["one", "two words", "three little words", "four"]
    responses = await harness.queue_then_release(texts)
    assert all(r.status_code == 200 for r in responses)
    assert len(harness.runner.batches[-1]) == 4  # one batch of four, after the holder's
    assert (await holder).status_code == 200
    # Each output is its own input's, not a neighbour's: row sums of word lengths + 1 + 2.
    sums = [r.json()["outputs"][0][0] for r in responses]
    assert sums == [3 + 3, 3 + 3 + 5, 3 + 5 + 6 + 5, 3 + 4]


async def test_draining_refuses_new_work_but_finishes_admitted(harness: Harness) -> None:
    holder = await harness.hold_the_worker()
    harness.service.drain.begin()
    refused = await harness.client.post("/infer", json={"inputs": "late"})
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "draining"
    assert refused.headers["connection"] == "close"
    assert (await harness.client.get("/readyz")).json()["status"] == "draining"
    drained = asyncio.create_task(harness.service.drain.wait(30, quiet_s=0))
    harness.release()
    assert (await holder).status_code == 200
    assert await drained


async def test_a_request_let_in_before_the_drain_finishes_though_its_body_comes_after(
    harness: Harness,
) -> None:
    """Its headers were let in (counted in flight, which the drain waits for): the drain
    must not refuse it once its body has been sent, after all."""

    async def body() -> AsyncIterator[bytes]:
        yield b'{"inputs": '
        harness.service.drain.begin()  # the middleware let the headers in; the body comes now
        yield b'"sent as the drain began"}'

    response = await harness.client.post(
        "/infer", content=body(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text
    assert await harness.service.drain.wait(30, quiet_s=0)


async def test_debug_endpoints_are_off_by_default_and_token_protected() -> None:
    async with start() as harness:
        assert (await harness.client.get("/debug/pool")).status_code == 404
    async with start(debug_token="s3cret") as harness:
        assert (await harness.client.get("/debug/pool")).status_code == 401
        wrong = {"authorization": "Bearer nope"}
        assert (await harness.client.get("/debug/config", headers=wrong)).status_code == 401
        auth = {"authorization": "Bearer s3cret"}
        pool = (await harness.client.get("/debug/pool", headers=auth)).json()
        assert pool["fake"]["misses"] == 0
        shapes = {(s["batch"], s["length"]) for s in pool["fake"]["shapes"]}
        assert (4, 16) in shapes and (1, 64) in shapes
        config = (await harness.client.get("/debug/config", headers=auth)).json()
        assert config["settings"]["debug_token"] == "***"
        assert config["threads"]["compute"] == 1


async def test_out_of_memory_splits_the_batch_and_answers_everyone(harness: Harness) -> None:
    holder = await harness.hold_the_worker()
    harness.runner.out_of_memory_above_rows = 1
    texts = ["a", "bb cc", "ddd eee fff", "g h"]
    responses = await harness.queue_then_release(texts)
    assert [r.status_code for r in responses] == [200] * 4
    sums = [r.json()["outputs"][0][0] for r in responses]
    assert sums == [3 + 1, 3 + 2 + 2, 3 + 9, 3 + 2]
    assert all(len(batch) == 1 for batch in harness.runner.batches[1:])
    assert (await holder).status_code == 200


async def test_a_failed_batch_drops_the_rest_of_its_request(harness: Harness) -> None:
    """A request answered with its first batch's failure must not have its other inputs
    computed afterwards, for nobody."""
    holder = await harness.hold_the_worker()
    five = ["a", "b", "c", "d", "qqqqqqqqq"]  # 4 rows per batch: the last one runs second
    failing = asyncio.create_task(harness.client.post("/infer", json={"inputs": five}))
    scheduler = harness.engine.hosts["fake"].batcher.scheduler
    await harness.until(lambda: scheduler.depth == 5, "all five queued")
    harness.runner.failure = RuntimeError("the device fell over")
    harness.release()
    assert (await holder).status_code == 200  # its batch was past the failure point
    assert (await failing).status_code == 500
    harness.runner.failure = None
    # One worker: anything of the failed request still queued would run before this.
    assert (await harness.client.post("/infer", json={"inputs": "yy"})).status_code == 200
    computed = [row for batch in harness.runner.batches for row in batch]
    assert [1, 9, 2] not in computed
    # The batch, then the known-good row that tells a failing server from a failing input
    # (`batch_triage`); with the device down, no row of the batch runs again.
    assert harness.runner.failed_batches == 2
    assert harness.engine.queued_inputs() == 0


async def test_a_request_failing_at_submission_leaves_no_counts_behind(harness: Harness) -> None:
    # The fake tokenizer does not enforce the limit, so the second input fits no bucket:
    # the engine refuses it whole, as the client's mistake.
    response = await harness.client.post("/infer", json={"inputs": ["short", "w " * 100]})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request"
    assert "total;dur=" in response.headers["server-timing"]
    assert harness.engine.queued_inputs() == 0
    assert harness.service.admission.inflight == 0
    assert harness.engine.hosts["fake"].batcher.scheduler.depth == 0
    assert (await harness.client.post("/infer", json={"inputs": "after"})).status_code == 200


async def test_a_failing_batch_loop_fails_queued_requests_and_recovers(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    batcher = harness.engine.hosts["fake"].batcher
    original_poll = batcher.scheduler.poll
    failures = iter([RuntimeError("a bug in the policy")])

    def poll_once_broken(now: float) -> object:
        error = next(failures, None)
        if error is not None:
            raise error
        return original_poll(now)

    monkeypatch.setattr(batcher.scheduler, "poll", poll_once_broken)
    failed = await harness.client.post("/infer", json={"inputs": "unlucky"})
    assert failed.status_code == 500
    assert "total;dur=" in failed.headers["server-timing"]
    recovered = await harness.client.post("/infer", json={"inputs": "next one"})
    assert recovered.status_code == 200
    assert harness.engine.queued_inputs() == 0
    assert harness.service.admission.inflight == 0


async def test_a_running_batch_is_in_the_backlog_until_it_ends(harness: Harness) -> None:
    """Admission weighs what is left of the running batches: the engine's backlog holds a
    batch's estimated compute while the model runs it, and drops it once it ends, whether
    or not it ran as long as estimated."""
    scheduler = harness.engine.hosts["fake"].batcher.scheduler
    # Pretend one-row batches of the smallest bucket take 10 s, so the held one is "long".
    for _ in range(30):  # the moving average reaches ~10 s
        scheduler.record_compute(BatchShape(1, 8), 10.0)
    assert harness.engine.backlog_seconds() == 0.0
    holder = await harness.hold_the_worker()
    assert harness.engine.backlog_seconds() > 9.0
    harness.release()
    assert (await holder).status_code == 200
    assert harness.engine.backlog_seconds() == 0.0
