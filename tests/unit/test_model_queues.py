"""Each model's own predicted wait (`app/model_queues.py`): what the engine admits a request
for it on, what its status publishes of it, and the front ends' verdict from that; with
one model, the whole engine's figures and verdict exactly as before."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest

from app.admission import Rejected, RejectReason, published_queue_verdict
from app.engine.core import EngineCore
from app.engine.protocol import (
    EmbedPayload,
    EngineStatus,
    GeneratePayload,
    ModelInfo,
    ModelQueue,
    Output,
    SamplingParams,
    Submit,
    TensorData,
    TensorOutput,
    ToEngine,
)
from app.main import create_app
from app.metrics import Metrics
from app.model_queues import NO_WORK, BatchCost, ModelWork, shed_verdict, wait_ahead
from app.model_specs import ModelSpec, TensorSpec
from app.settings import Settings
from loadtest.null_engine import AlwaysReadyEngine
from tests.support.asgi import serving
from tests.support.engine_status import ready_status
from tests.support.fake_model import GatedLoader
from tests.support.manual_clock import ManualClock
from tests.support.stand_in_host import StandInHost

BUDGET_S = 0.100


def test_a_model_waits_for_the_running_batches_and_one_batch_of_each_other_model() -> None:
    works = {
        "flooded": ModelWork(running_s=0.030, queued_s=2.0, next_batch_s=0.040),
        "idle": ModelWork(running_s=0.0, queued_s=0.0, next_batch_s=0.0),
        "busy": ModelWork(running_s=0.010, queued_s=0.050, next_batch_s=0.020),
    }
    # Divided among 2 compute slots.
    assert wait_ahead("idle", works, 2) == pytest.approx((0.040 + 0.040 + 0.020) / 2)
    assert wait_ahead("busy", works, 2) == pytest.approx((0.040 + 0.050 + 0.040) / 2)
    assert wait_ahead("flooded", works, 2) == pytest.approx((0.040 + 2.0 + 0.020) / 2)
    # A model the engine does not serve: what runs and one batch of each.
    assert wait_ahead("other", works, 1) == pytest.approx(0.040 + 0.040 + 0.020)


def test_another_model_takes_a_turn_before_each_of_a_models_batches_ahead() -> None:
    """A model that took a compute slot rejoins the line at its back: before each of the
    batches of `model` queued ahead of an input, and before that input's own, every other
    model with work runs one, as many as it has."""
    works = {
        "a": ModelWork(0.0, queued_s=0.160, next_batch_s=0.040, batches_ahead=4, turns=4),
        "b": ModelWork(0.010, queued_s=0.160, next_batch_s=0.080, batches_ahead=2, turns=2),
        "tiny": ModelWork(0.0, 0.0, next_batch_s=0.005, turns=1000),  # decoding
        "idle": NO_WORK,
    }
    # `b`: 3 turns of each other model; `a` has 4.
    assert wait_ahead("b", works, 1) == pytest.approx(0.010 + 0.160 + 3 * 0.040 + 3 * 0.005)
    # `a`: 5 turns of each other model; `b` has only 2.
    assert wait_ahead("a", works, 2) == pytest.approx((0.010 + 0.160 + 2 * 0.080 + 5 * 0.005) / 2)
    # Nothing queued ahead: one batch of each, as before.
    assert wait_ahead("idle", works, 1) == pytest.approx(0.010 + 0.040 + 0.080 + 0.005)


def test_with_one_model_its_wait_is_the_whole_engines_backlog() -> None:
    for running, queued in itertools.product((0.0, 0.013, 0.1), (0.0, 0.07, 1.234)):
        works = {"m": ModelWork(running, queued, 0.05)}
        for workers in (1, 3):
            assert wait_ahead("m", works, workers) == (0.0 + (running + queued)) / workers


# --- one model: the published figures and verdict are the whole engine's, exactly -----
ONE_MODEL = Settings(
    models=(ModelSpec(name="m", source="unused"),),
    length_buckets=(16, 32),
    max_batch_size=4,
    max_wait_ms=60_000,
    max_queue_delay_ms=BUDGET_S * 1000,
    warmup=False,
    spike_reports=False,
    dispatcher_threads=2,
    torch_threads=1,
)


@pytest.fixture
async def one_model() -> AsyncIterator[tuple[EngineCore, GatedLoader]]:
    loader = GatedLoader()
    core = EngineCore(ONE_MODEL, Metrics(), loader=loader, clock=ManualClock(10.0))
    await core.start()
    try:
        yield core, loader
    finally:
        for runner in loader.runners.values():
            runner.gate.set()
        for origin, request_id in list(core._requests):
            core.cancel(origin, request_id)
        await core.stop()


WHOLE_ENGINE = (
    "backlog_s",
    "seconds_per_input",
    "queued_inputs",
    "least_own_compute_s",
    "batch_rows",
    "full_batch_s",
)


def assert_one_model_verdicts_unchanged(status: EngineStatus) -> None:
    queue = status.models["m"].queue
    assert queue is not None
    for name in WHOLE_ENGINE:
        assert getattr(queue, name) == getattr(status, name), name
    for sent, time_left, own_deadline in itertools.product(
        range(12), (0.001, 0.05, 0.5, 30.0), (False, True)
    ):
        now = 10.0
        budget = time_left if own_deadline else BUDGET_S
        old = published_queue_verdict(status, sent, now + time_left, now, budget)
        new = shed_verdict(status, sent, now + time_left, now, budget)
        if old is None:
            assert new is None, (sent, time_left)
            continue
        assert new is not None, (sent, time_left)
        assert (new.reason, new.retry_after_s, new.message) == (
            old.reason,
            old.retry_after_s,
            old.message,
        )


async def test_one_models_published_verdict_is_the_old_formulas(
    one_model: tuple[EngineCore, GatedLoader],
) -> None:
    core, loader = one_model
    assert_one_model_verdicts_unchanged(core.status())  # nothing measured yet
    scheduler = core.hosts["m"].batcher.scheduler  # type: ignore[attr-defined]
    for shape in scheduler.policy.shapes():
        scheduler.record_compute(shape, 0.003 + 0.0071 * shape.batch * shape.length / 16)
    ids = itertools.count(1)

    def send(tokens: int) -> None:
        payload = EmbedPayload([[1] * tokens])
        core.submit(b"fe", Submit(next(ids), "m", 1e9, payload), lambda answer: None)

    runner = loader.runners["m"]
    runner.gate.clear()
    for tokens in (3, 20, 3, 3, 3, 20, 3, 3):  # a full batch of 4 goes, 4 stay in 2 buckets
        send(tokens)
        assert_one_model_verdicts_unchanged(core.status())
    await asyncio.to_thread(runner.started.acquire, timeout=10)
    for step in range(20):  # a batch running, its end nearing, the queue growing
        core._clock.now += 0.002  # type: ignore[attr-defined]
        send(3 if step % 3 else 20)
        assert_one_model_verdicts_unchanged(core.status())


# --- several models: the front end's verdict ------------------------------------------
def queue(backlog_s: float, queued: int = 0, per_input: float = 0.010) -> ModelQueue:
    return ModelQueue(backlog_s, per_input, queued, per_input, 4, 4 * per_input)


def status_of(**queues: ModelQueue | None) -> EngineStatus:
    models = {name: ModelInfo("embed", 4, 64, q) for name, q in queues.items()}
    # The whole engine's figures: over any budget (what front ends shed by before).
    return ready_status("e", 1.0, backlog_s=9.0, seconds_per_input=0.01, models=models)


def test_a_request_of_an_unknown_model_is_refused_only_when_every_model_would_refuse() -> None:
    verdict = shed_verdict(status_of(a=queue(0.5), b=queue(0.05)), 0, 30.0, 0.0, BUDGET_S)
    assert verdict is None
    refused = shed_verdict(status_of(a=queue(0.5), b=queue(0.2)), 0, 30.0, 0.0, BUDGET_S)
    # The least loaded model's: b's 200 + 10 ms, 110 ms over.
    assert refused is not None and refused.reason is RejectReason.QUEUE
    assert refused.retry_after_s == pytest.approx(0.110)
    # Inputs let in whose model is not known yet count against every model.
    assert shed_verdict(status_of(a=queue(0.5), b=queue(0.05)), 10, 30.0, 0.0, BUDGET_S)


def test_a_path_is_judged_on_the_models_of_its_task_alone() -> None:
    """/v1/embeddings reaches no generate model: an embedding flood is shed before its body
    although the generate model's own wait is short; /infer (any task) is let in."""
    models = {
        "minilm": ModelInfo("embed", 4, 64, queue(0.5)),
        "tiny": ModelInfo("generate", 0, 64, queue(0.0, per_input=0.0)),
    }
    status = ready_status("e", 1.0, backlog_s=0.5, seconds_per_input=0.01, models=models)
    refused = shed_verdict(status, 0, 30.0, 0.0, BUDGET_S, task="embed")
    assert refused is not None and refused.reason is RejectReason.QUEUE
    assert shed_verdict(status, 0, 30.0, 0.0, BUDGET_S, task="generate") is None
    assert shed_verdict(status, 0, 30.0, 0.0, BUDGET_S) is None
    # A task no model has (answered 400 once the body is read): judged on every model.
    assert shed_verdict(status, 0, 30.0, 0.0, BUDGET_S, task="tensor") is None


def test_of_refusals_a_retryable_one_is_answered() -> None:
    # `slow` computes 200 ms alone, more than the 150 ms the deadline leaves (504); `busy`
    # only waits too long (429): the request may be for `busy`, which a retry may serve.
    status = status_of(slow=queue(0.0, per_input=0.200), busy=queue(0.5))
    refused = shed_verdict(status, 0, 0.150, 0.0, BUDGET_S)
    assert refused is not None and refused.reason is RejectReason.QUEUE
    assert refused.retry_after_s == pytest.approx(0.410)
    # 40 ms left: too little for either.
    refused = shed_verdict(status, 0, 0.040, 0.0, BUDGET_S)
    assert refused is not None and refused.reason is RejectReason.DEADLINE


def test_a_named_model_is_judged_on_its_own_queue() -> None:
    status = status_of(a=queue(0.5), b=queue(0.05))
    assert shed_verdict(status, 0, 30.0, 0.0, BUDGET_S, model="b") is None
    refused = shed_verdict(status, 0, 30.0, 0.0, BUDGET_S, model="a")
    assert refused is not None and refused.retry_after_s == pytest.approx(0.410)
    assert refused.message.startswith("model 'a': predicted wait 510 ms")
    # A model the engine does not serve (answered 404 once the body is read): any model.
    assert shed_verdict(status, 0, 30.0, 0.0, BUDGET_S, model="nope") is None


def test_an_engine_that_publishes_no_models_queue_is_judged_on_its_whole_backlog() -> None:
    refused = shed_verdict(status_of(a=None), 0, 30.0, 0.0, BUDGET_S)
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.QUEUE


# --- the engine: each model's load, generation's included ---------------------------
REFUSED = Rejected(RejectReason.QUEUE, "stand-in")  # nothing is queued


def ignore(answer: object) -> None:
    pass


def test_generation_waits_for_one_batch_of_a_flooded_model_not_its_queue() -> None:
    core = EngineCore(Settings(dispatcher_threads=2, torch_threads=1), Metrics())
    flood = ModelWork(running_s=0.010, queued_s=1.0, next_batch_s=0.040)
    embedder = StandInHost("embed", flood, BatchCost(0.010, 4, 0.040, 0.010), 100, REFUSED)
    generator = StandInHost("generate", ModelWork(0.0, 0.0, 0.005), None, 3, REFUSED)
    core.hosts = {"minilm": embedder, "tiny": generator}  # type: ignore[dict-item]
    core._ready = True
    sampling = SamplingParams(max_new_tokens=4)
    core.submit(b"fe", Submit(1, "tiny", 1e9, GeneratePayload([1, 2], sampling)), ignore)
    core.submit(b"fe", Submit(2, "minilm", 1e9, EmbedPayload([[1, 2]])), ignore)
    # It was the whole engine's backlog: (0.010 + 1.0) / 2.
    assert generator.loads[0].backlog_s == pytest.approx((0.010 + 0.040) / 2)
    assert embedder.loads[0].backlog_s == pytest.approx((0.010 + 1.0 + 0.005) / 2)
    assert embedder.loads[0].queued_inputs == 100  # its own queue, which `max_queue` caps
    status = core.status()
    assert status.backlog_s == pytest.approx(1.010 / 2)  # the whole engine's, as before
    tiny = status.models["tiny"].queue
    assert tiny == ModelQueue((0.010 + 0.040) / 2, 0.0, 0, 0.0, 1, 0.0)
    minilm = status.models["minilm"].queue
    assert minilm == ModelQueue((0.010 + 1.0 + 0.005) / 2, 0.005, 100, 0.010, 4, 0.040)


# --- v2: the path names the model ----------------------------------------------------
def tensor_model(name: str) -> ModelSpec:
    return ModelSpec(
        name=name,
        task="tensor",
        source="unused.pt2",
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(-1, 2)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(-1, 1)),),
    )


V2_SETTINGS = Settings(
    models=(tensor_model("flooded"), tensor_model("idle")), max_queue_delay_ms=BUDGET_S * 1000
)


class FloodedEngine(AlwaysReadyEngine):
    """`flooded` has 500 ms queued; `idle` waits for one of its batches (40 ms). The whole
    engine's backlog is 500 ms."""

    def __init__(self) -> None:
        super().__init__(V2_SETTINGS, backlog_s=0.5)

    def model_info(self, spec: ModelSpec) -> ModelInfo:
        backlog_s = 0.5 if spec.name == "flooded" else 0.040
        return ModelInfo(spec.task, 0, 1, queue(backlog_s))

    def status(self) -> EngineStatus | None:
        status = super().status()
        assert status is not None
        return msgspec.structs.replace(status, seconds_per_input=0.010, least_own_compute_s=0.01)

    def _send(self, message: ToEngine) -> None:
        if isinstance(message, Submit):
            payload = TensorOutput([TensorData("y", "FP32", [1, 1], bytes(4))])
            self._deliver(Output(message.request_id, True, payload, queue_s=0.0, compute_s=0.0))


async def test_v2_sheds_a_request_by_its_models_own_wait() -> None:
    body: dict[str, Any] = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2]}]}
    body["inputs"][0]["data"] = [0.5, 0.5]
    app = create_app(V2_SETTINGS, engine=FloodedEngine())
    client: httpx.AsyncClient
    async with serving(app) as client:
        idle = await client.post("/v2/models/idle/infer", json=body)
        flooded = await client.post("/v2/models/flooded/infer", json=body)
    assert idle.status_code == 200, idle.text  # was 429: the whole engine's 500 ms
    assert flooded.status_code == 429
    assert flooded.headers["retry-after"] == "1"  # 510 ms, 410 ms over: rounded up
    assert "model 'flooded': predicted wait 510 ms" in flooded.json()["error"]
