"""A server's life around its queue, with the scheduling harness (an in-process engine and
a gated fake model, tests/support/scheduling.py): `/readyz` through warm-up and the
estimates warm-up leaves, the in-flight and queue caps' 429s, draining (new work refused,
admitted work finished, a body sent after the drain began), and the debug endpoints."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from app.admission import RejectReason
from app.api.errors import RETRY_ELSEWHERE_HEADER
from app.main import create_app
from app.settings import Settings
from tests.support.asgi import serving
from tests.support.fake_model import GatedLoader
from tests.support.scheduling import BASE, Harness, start


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
