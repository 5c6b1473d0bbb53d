"""Overload behaviour through the ASGI app with an in-process engine and the gated fake
model: shedding before the body is read, stalled bodies, compute slots shared by models,
and run-time health."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.model_specs import ModelSpec
from tests.support.asgi import post_directly
from tests.support.scheduling import start

ONE_MIB = 1 << 20


async def call_without_body(app: Any, path: str, receive: Any) -> tuple[int, dict[str, str]]:
    """Drive the ASGI app directly with a POST declaring a 1 MiB body; `receive` decides
    what (if anything) of the body arrives."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(ONE_MIB - 1).encode()),
    ]
    return await post_directly(app, path, headers, receive)


async def test_an_overloaded_server_answers_429_without_reading_the_body() -> None:
    async with start(max_queue_delay_ms=50, max_body_bytes=ONE_MIB) as harness:
        # The engine has measured ten seconds per batch (fed to its estimates as warm-up
        # would): the batch held in the model is then that much work ahead of anything
        # new, far beyond the budget.
        scheduler = harness.engine.hosts["fake"].batcher.scheduler
        for shape in scheduler.policy.shapes():
            for _ in range(30):  # the moving average reaches ~10 s
                scheduler.record_compute(shape, 10.0)
        holder = await harness.hold_the_worker()
        body_reads = 0

        async def receive() -> dict[str, Any]:
            nonlocal body_reads
            body_reads += 1
            raise AssertionError("the body was read")

        app = harness.client._transport.app  # type: ignore[attr-defined]
        status, headers = await call_without_body(app, "/infer", receive)
        assert status == 429
        assert int(headers["retry-after"]) >= 1
        assert body_reads == 0
        metrics = (await harness.client.get("/metrics")).text
        assert 'steadyserve_rejected_total{model="",reason="queue"} 1.0' in metrics
        harness.release()
        assert (await holder).status_code == 200


async def test_a_body_that_stalls_midway_is_cut_off_with_408() -> None:
    async with start(body_read_timeout_s=0.2, max_body_bytes=ONE_MIB) as harness:
        chunks = [b'{"inputs": "the start of a body that never ends']
        stalled = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if chunks:
                return {"type": "http.request", "body": chunks.pop(), "more_body": True}
            stalled.set()
            await asyncio.Event().wait()  # the client sends nothing more, ever
            raise AssertionError("unreachable")

        app = harness.client._transport.app  # type: ignore[attr-defined]
        status, headers = await asyncio.wait_for(call_without_body(app, "/infer", receive), 10)
        assert stalled.is_set()
        assert status == 408
        assert headers["connection"] == "close"
        assert harness.service.admission.inflight == 0


async def test_two_models_sharing_the_dispatcher_never_oversubscribe_it() -> None:
    models = (ModelSpec(name="fake"), ModelSpec(name="other"))
    async with start(models=models) as harness:
        other = harness.runner_of("other")
        warmed_up = len(other.batches)
        holder = await harness.hold_the_worker()  # the one compute thread, on "fake"
        waiting = asyncio.create_task(
            harness.client.post("/infer", json={"model": "other", "inputs": "second model"})
        )
        scheduler = harness.engine.hosts["other"].batcher.scheduler
        await harness.until(lambda: scheduler.depth == 1, "queued on the other model")
        # Its batcher sees no free slot: however often the loop turns, the input stays
        # queued (a batcher counting the whole dispatcher as its own would take it).
        for _ in range(200):
            await asyncio.sleep(0)
        assert scheduler.depth == 1
        assert harness.engine.slots.free == 0
        harness.release()
        assert (await holder).status_code == 200
        assert (await waiting).status_code == 200
        assert len(other.batches) == warmed_up + 1
        assert harness.engine.slots.free == 1


async def test_a_model_with_a_batch_ready_is_not_starved_by_one_that_always_has_one() -> None:
    """A slot given back went to whichever batch loop resumed first: the first-registered
    model's, while its queue was never empty, so the other model's input waited out every
    batch queued before it (or its deadline)."""
    models = (ModelSpec(name="fake"), ModelSpec(name="other"))
    async with start(models=models) as harness:
        order: list[str] = []
        for name in ("fake", "other"):
            runner = harness.runner_of(name)
            runner.batches.clear()
            forward = runner.forward

            def recorded(ids: Any, mask: Any, name: str = name, forward: Any = forward) -> Any:
                order.append(name)
                return forward(ids, mask)

            runner.forward = recorded  # type: ignore[method-assign]
        holder = await harness.hold_the_worker()  # the one compute thread, on "fake"
        fake_queue = harness.engine.hosts["fake"].batcher.scheduler
        floods = [
            asyncio.create_task(harness.client.post("/infer", json={"inputs": f"flood {i}"}))
            for i in range(4 * 4)  # four full batches of "fake", ready before "other"'s
        ]
        await harness.until(lambda: fake_queue.depth == 16, "the flood queued")
        other_queue = harness.engine.hosts["other"].batcher.scheduler
        waiting = asyncio.create_task(
            harness.client.post("/infer", json={"model": "other", "inputs": "second model"})
        )
        await harness.until(lambda: other_queue.depth == 1, "queued on the other model")
        harness.release()
        assert (await holder).status_code == 200
        assert (await waiting).status_code == 200
        assert all(r.status_code == 200 for r in await asyncio.gather(*floods))
        # The held batch, then the batch "fake" had ready first, then "other"'s turn.
        assert order.index("other") <= 2, order


async def test_batches_that_keep_failing_turn_healthz_unhealthy_until_one_succeeds() -> None:
    async with start(unhealthy_after_failed_batches=2) as harness:
        assert (await harness.client.get("/healthz")).status_code == 200
        harness.runner.failure = RuntimeError("device lost")
        for _ in range(2):
            failed = await harness.client.post("/infer", json={"inputs": "doomed"})
            assert failed.status_code == 500
        unhealthy = await harness.client.get("/healthz")
        assert unhealthy.status_code == 503
        problem = unhealthy.json()["problem"]
        assert problem == "model 'fake': 2 consecutive batches failed (RuntimeError)"
        harness.runner.failure = None
        assert (await harness.client.post("/infer", json={"inputs": "fine"})).status_code == 200
        assert (await harness.client.get("/healthz")).status_code == 200


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
async def test_probes_do_not_show_exception_text(path: str) -> None:
    """A failed start-up is reported by kind, never with its message (paths, secrets)."""
    from tests.support.fake_model import GatedLoader

    class BrokenLoader(GatedLoader):
        def __call__(self, *args: Any) -> Any:
            raise OSError("/secret/path/to/weights: permission denied")

    from app.main import create_app
    from app.settings import Settings
    from tests.support.asgi import serving
    from tests.support.scheduling import BASE

    loader = BrokenLoader()
    app = create_app(Settings(**BASE), loader=loader, tokenizer_loader=loader.tokenizer)  # type: ignore[arg-type]
    async with serving(app, wait_ready=False) as client:
        await app.state.startup_task
        with pytest.raises(Exception, match="start-up failed"):
            await app.state.service.engine.wait_ready()
        response = await client.get(path)
        assert response.status_code == 503
        assert "secret" not in response.text
        assert "OSError" in response.text


@pytest.mark.parametrize("path", ["/infer", "/v2/models/fake/infer"])
async def test_a_request_waiting_for_100_continue_is_refused_with_its_connection_closed(
    path: str,
) -> None:
    """A client that sent `Expect: 100-continue` and hears a final answer never sends the
    body it declared, but the server's parser still waits for it: the connection, left
    open, took the client's next request as that body. Refused from its headers (by the
    middleware, or the v2 route), such a request's connection is closed, as the HTTP
    protocol closes it."""
    async with start(max_queue_delay_ms=50) as harness:
        scheduler = harness.engine.hosts["fake"].batcher.scheduler
        for shape in scheduler.policy.shapes():
            for _ in range(30):  # ten seconds a batch, as in the first test here
                scheduler.record_compute(shape, 10.0)
        holder = await harness.hold_the_worker()

        async def receive() -> dict[str, Any]:
            raise AssertionError("the body was read")

        app = harness.client._transport.app  # type: ignore[attr-defined]
        expecting = [
            (b"content-type", b"application/json"),
            (b"content-length", b"1000"),
            (b"expect", b"100-continue"),
        ]
        status, headers = await post_directly(app, path, expecting, receive)
        assert (status, headers.get("connection")) == (429, "close")
        # Without the expectation, the connection stays usable.
        status, headers = await post_directly(app, path, expecting[:2], receive)
        assert (status, headers.get("connection")) == (429, None)
        harness.release()
        assert (await holder).status_code == 200


@pytest.mark.parametrize("path", ["/infer", "/v2/models/fake/infer"])
async def test_a_request_refused_while_draining_has_its_connection_closed(path: str) -> None:
    """While draining, new requests get 503 with `Connection: close` (README, "Shutdown"),
    so a keep-alive client takes its next request to another replica: on the v2 route too,
    which sheds for itself (the Server-Timing middleware closes every answer while the
    server drains)."""
    async with start() as harness:
        harness.service.drain.begin()

        async def receive() -> dict[str, Any]:
            raise AssertionError("the body was read")

        app = harness.client._transport.app  # type: ignore[attr-defined]
        headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]
        status, answered = await post_directly(app, path, headers, receive)
        assert (status, answered.get("connection")) == (503, "close")
