"""The queue, through the ASGI app with an in-process engine and a gated fake model
(tests/support/scheduling.py), so each test decides when a batch finishes: waiting
requests batched together, a deadline passing in the queue, cancellation and a client
disconnect, a batch split on out-of-memory or failed, a failing batch loop, and the
backlog of running batches (the point here is the queue, not the numbers; the engine
process runs the real model in `test_embeddings.py`).

Warm-up, the caps, draining and the debug endpoints are in test_server_lifecycle.py."""

from __future__ import annotations

import asyncio

import pytest

from app.api.cancellation import ClientDisconnected, run_until_disconnect
from app.embedding_service import embed_texts
from app.engine.protocol import EmbedPayload, Submit
from app.scheduler import BatchShape
from app.timing import PhaseTimer
from tests.support.scheduling import Harness


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
