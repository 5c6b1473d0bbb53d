"""Each model is admitted on its own predicted wait: a flood on one model fills that model's
queue to its delay budget, and another model, idle, still gets its requests in, in the
engine and before the body in front ends. It used to wait behind the whole engine's
backlog: every request for it was refused 429 `queue` (before its body was read), though
it waits at most for the running batches and one batch of the flooded model (the compute
slots take one place in line per model, first come; with both flooded, a batch of the other
before each of its own batches ahead).

A real `EngineCore` over the stand-in model (`tests/support/fake_model.py`) on a manual
clock, warm-up off and compute estimates seeded by hand, batches held back by a minute's
`max_wait_ms` (nothing computes unless the test lets the loop run); front ends' verdicts
from that engine's own status."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from app.admission import Entry, Rejected, RejectReason
from app.engine.core import EngineCore
from app.engine.protocol import EmbedPayload, EngineStatus, Failure, FromEngine, Submit
from app.metrics import Metrics
from app.model_queues import shed_verdict
from app.model_specs import ModelSpec
from app.service import Service
from app.settings import Settings
from loadtest.null_engine import AlwaysReadyEngine
from tests.support.fake_model import GatedLoader
from tests.support.manual_clock import ManualClock

ORIGIN = b"front-end"
BUDGET_MS = 100.0
SETTINGS = Settings(
    models=(ModelSpec(name="a", source="unused"), ModelSpec(name="b", source="unused")),
    length_buckets=(16, 32),
    max_batch_size=4,
    max_wait_ms=60_000,
    max_queue_delay_ms=BUDGET_MS,
    warmup=False,
    spike_reports=False,
    dispatcher_threads=1,
    torch_threads=1,
)
# Compute seconds of a batch of 1, 2 and 4 rows: `a` 10 ms an input in full batches of 40
# ms; `b` dearer (30 ms alone, 80 ms for a full batch).
COSTS = {"a": {1: 0.010, 2: 0.020, 4: 0.040}, "b": {1: 0.030, 2: 0.050, 4: 0.080}}


@contextlib.asynccontextmanager
async def measured_core(settings: Settings) -> AsyncIterator[EngineCore]:
    """A started core, its compute estimates `COSTS`."""
    loader = GatedLoader()
    core = EngineCore(settings, Metrics(), loader=loader, clock=ManualClock(100.0))
    await core.start()
    assert core.ready
    for name, costs in COSTS.items():
        scheduler = core.hosts[name].batcher.scheduler  # type: ignore[attr-defined]
        for shape in scheduler.policy.shapes():
            scheduler.record_compute(shape, costs[shape.batch])
    core.loader = loader  # type: ignore[attr-defined]
    try:
        yield core
    finally:
        for runner in loader.runners.values():
            runner.gate.set()
        for origin, request_id in list(core._requests):
            core.cancel(origin, request_id)  # else `stop` waits out their minute
        await core.stop()


@pytest.fixture
async def core() -> AsyncIterator[EngineCore]:
    async with measured_core(SETTINGS) as core:
        yield core


class Requests:
    """One-input requests sent to `core` (`Submit`s, as a front end sends them)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.ids = iter(range(1, 10_000))

    def send(self, model: str) -> list[FromEngine]:
        """Its answers so far: none while it is queued, else its refusal."""
        answers: list[FromEngine] = []
        deadline = self.core._clock() + 60
        request = Submit(next(self.ids), model, deadline, EmbedPayload([[1, 5, 2]]))
        self.core.submit(ORIGIN, request, answers.append)
        return answers

    def flood(self, model: str) -> tuple[int, Failure]:
        """Send until one is refused: how many were queued, and that refusal."""
        for queued in range(1000):
            answers = self.send(model)
            if answers:
                refusal = answers[0]
                assert isinstance(refusal, Failure), refusal
                return queued, refusal
        raise AssertionError("never refused")


async def test_a_flood_on_one_model_leaves_an_idle_model_admitted(core: EngineCore) -> None:
    requests = Requests(core)
    # `a` is let in while its own wait fits 100 ms: 8 queued are 2 full batches ahead
    # (80 ms) and a full one of its own (40 ms) for the next, 120 ms: refused, 20 ms over.
    queued, refusal = requests.flood("a")
    assert queued == 8
    assert refusal.reason == RejectReason.QUEUE.value
    assert refusal.retry_after_s == pytest.approx(0.020)
    # `b` waits for one batch of `a` (40 ms: the line takes one batch of each model in
    # turn), then its own: 30 ms alone, 70 ms. It was refused: `a`'s 80 ms queued, and its
    # own 30, 110 ms.
    assert requests.send("b") == []
    # A second `b` input shares a batch of 2 (50 ms), 90 ms; a third, a full batch of 4 (80
    # ms), 120 ms: `b`'s own wait is over, and its refusal says so, 20 ms over.
    assert requests.send("b") == []
    [refused] = requests.send("b")
    assert isinstance(refused, Failure) and refused.reason == RejectReason.QUEUE.value
    assert refused.retry_after_s == pytest.approx(0.020)
    assert "'b'" in refused.message and "120 ms" in refused.message
    assert core.hosts["a"].queued_inputs() == 8 and core.hosts["b"].queued_inputs() == 2


async def test_the_running_batches_are_ahead_of_every_model(core: EngineCore) -> None:
    """What is left of a running batch is waited for, whichever model it is of: `a`'s
    full batch of 40 ms runs (on the one compute slot), 5 ms of it gone."""
    runner = core.loader.runners["a"]  # type: ignore[attr-defined]
    runner.gate.clear()
    requests = Requests(core)
    for _ in range(4):
        assert requests.send("a") == []
    await asyncio.to_thread(runner.started.acquire, timeout=10)  # the batch is on the slot
    core._clock.now += 0.005  # type: ignore[attr-defined]
    # 35 ms left of it, then `b`'s own batch: of 1 (30 ms), 65 ms; of 2 (50 ms), 85 ms; of
    # 3, padded to 4 (80 ms), 115 ms: refused, 15 ms over.
    assert requests.send("b") == []
    assert requests.send("b") == []
    [refused] = requests.send("b")
    assert isinstance(refused, Failure) and refused.reason == RejectReason.QUEUE.value
    assert refused.retry_after_s == pytest.approx(0.015)


async def test_with_both_models_flooded_each_waits_for_the_others_turns() -> None:
    """The compute slots take turns: the other model runs a batch before each of a model's
    batches queued ahead of an input, and before its own (as many as it has). One batch of
    the other model was counted, whatever the queue: a `b` input behind 2 batches of `b`
    was predicted to wait 280 ms, and waited 360."""
    settings = SETTINGS.model_copy(update={"max_queue_delay_ms": 60_000.0})  # all let in
    async with measured_core(settings) as core:
        requests = Requests(core)
        for model, inputs in (("a", 16), ("b", 8)):  # 4 full batches of `a`, 2 of `b`
            for _ in range(inputs):
                assert requests.send(model) == []
        status = core.status()
        queues = {name: info.queue for name, info in status.models.items()}
        # `a`'s 160 ms queued, and before each of its 4 batches and its own, a turn of `b`:
        # `b` has 2 (80 ms each). It was 160 + 80.
        assert queues["a"] is not None and queues["a"].backlog_s == pytest.approx(0.320)
        # `b`'s 160 ms queued, and 3 of `a`'s 4 turns (40 ms each). It was 160 + 40.
        assert queues["b"] is not None and queues["b"].backlog_s == pytest.approx(0.280)
        # A `b` input 300 ms from its deadline: the 120 ms of `a` and 2 full batches of `b`
        # ahead, then its own behind them, a full one (80 ms): 360 ms. It was let in (280).
        now = core._clock()
        request = Submit(next(requests.ids), "b", now + 0.3, EmbedPayload([[1, 5, 2]]))
        answers: list[FromEngine] = []
        core.submit(ORIGIN, request, answers.append)
        [refused] = answers
        assert isinstance(refused, Failure) and refused.reason == RejectReason.DEADLINE.value
        assert "predicted wait 360 ms" in refused.message
        # Front ends judge it alike before its body, from the published queue of `b`.
        verdict = shed_verdict(status, 0, now + 0.3, now, 60.0, model="b")
        assert isinstance(verdict, Rejected) and verdict.reason is RejectReason.DEADLINE
        assert "predicted wait 360 ms" in verdict.message


async def test_an_input_waits_for_the_others_turns_before_its_buckets_batches() -> None:
    """Which of a model's batches an input waits behind depends on its length bucket: it
    joins a partial batch of its own bucket, but one in another bucket runs first (ready
    buckets run oldest first), and the other model takes a turn before that one too; a
    request of more rows than a batch waits for a turn between its own batches. A partial
    batch in any bucket was taken to be the input's: one turn of the flooded `b` was
    counted, 100 ms predicted for an input that waits 180."""
    settings = SETTINGS.model_copy(update={"max_queue_delay_ms": 60_000.0})  # all let in
    async with measured_core(settings) as core:
        requests = Requests(core)
        for _ in range(12):  # 3 full batches of `b` (80 ms each)
            assert requests.send("b") == []
        assert requests.send("a") == []  # 3 tokens: a partial batch in the 16-token bucket
        now = core._clock()

        def send(deadline_s: float, *inputs: list[int]) -> list[FromEngine]:
            request = Submit(next(requests.ids), "a", now + deadline_s, EmbedPayload([*inputs]))
            answers: list[FromEngine] = []
            core.submit(ORIGIN, request, answers.append)
            return answers

        # 20 tokens (the 32-token bucket): `a`'s queued input (10 ms), a turn of `b` before
        # its batch and one before its own, then its own batch of 1 (10 ms): 180 ms.
        [refused] = send(0.150, [1] * 20)
        assert isinstance(refused, Failure) and refused.reason == RejectReason.DEADLINE.value
        assert "predicted wait 180 ms" in refused.message
        # 5 inputs of 20 tokens: that, and a turn before its second batch (a full one of 4,
        # then its last, 40 ms each): 10 + 3 * 80 + 80 = 330 ms. It was 10 + 80 + 80.
        [refused] = send(0.300, *[[1] * 20] * 5)
        assert isinstance(refused, Failure) and refused.reason == RejectReason.DEADLINE.value
        assert "predicted wait 330 ms" in refused.message
        # Front ends do not know the bucket before the body: `a`'s published wait is the
        # least over its buckets, an input joining its partial batch's (10 + 80 ms), so a
        # front end lets in what the engine admits: 3 tokens join it, after a turn of `b`
        # (80 ms) a batch of 2 (20 ms), 100 ms.
        status = core.status()
        queue = status.models["a"].queue
        assert queue is not None and queue.backlog_s == pytest.approx(0.090)
        assert shed_verdict(status, 0, now + 0.115, now, 60.0, model="a") is None
        assert send(0.115, [1, 5, 2]) == []


async def test_the_queue_cap_is_each_models_own() -> None:
    """`max_queue` caps each model's inputs waiting for a batch: a model at its cap does
    not have another model's requests refused."""
    settings = SETTINGS.model_copy(update={"max_queue": 4, "max_inputs_per_request": 4})
    core = EngineCore(settings, Metrics(), loader=GatedLoader(), clock=ManualClock(100.0))
    await core.start()
    try:
        requests = Requests(core)  # compute not measured (warm-up off): nothing is waited for
        queued, refusal = requests.flood("a")
        assert queued == 4 and refusal.reason == RejectReason.QUEUE.value
        assert requests.send("b") == []
    finally:
        for origin, request_id in list(core._requests):
            core.cancel(origin, request_id)
        await core.stop()


class EngineOf(AlwaysReadyEngine):
    """Front ends' view of `core`: its status, as it publishes it; nothing in transit."""

    def __init__(self, settings: Settings, core: EngineCore) -> None:
        super().__init__(settings)
        self.core = core

    def status(self) -> EngineStatus | None:
        return self.core.status()


async def front_end(core: EngineCore) -> Service:
    def no_tokenizer(spec: ModelSpec, largest: int) -> Any:
        return object()

    clock = ManualClock(100.0)
    service = Service(
        SETTINGS, Metrics(), EngineOf(SETTINGS, core), tokenizer_loader=no_tokenizer, clock=clock
    )
    await service.start()
    return service


async def test_front_ends_let_in_a_request_some_model_has_room_for(core: EngineCore) -> None:
    """Before the body the model is not known (/infer, /v1): shed only when every model
    would refuse it. Under the flood on `a`, an idle `b` has room."""
    service = await front_end(core)  # before the flood: nothing runs until the test awaits
    Requests(core).flood("a")
    entry = service.shed(None)
    assert isinstance(entry, Entry), entry
    service.leave(entry)


async def test_v2_sheds_by_the_named_models_own_wait(core: EngineCore) -> None:
    """/v2/models/{name}/infer names its model before the body: its own wait alone."""
    service = await front_end(core)  # before the flood: nothing runs until the test awaits
    Requests(core).flood("a")
    refused = service.shed(None, model="a")
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.QUEUE
    assert refused.retry_after_s == pytest.approx(0.020)  # `a`'s own 120 ms, 20 ms over
    assert "'a'" in refused.message
    entry = service.shed(None, model="b")
    assert isinstance(entry, Entry), entry
    service.leave(entry)
