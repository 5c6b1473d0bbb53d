"""An embedding with a NaN or an infinity is failed in the engine (`ModelBatcher.rows_failed`),
not only refused by the front end: its row is answered 500 `non_finite_output` (the body the
front end's check gave), the batch counts toward the model's ill health and is logged once.
The front end alone saw it, and the engine recorded the batch as a success, which cleared
the model's failure count: a model computing NaN for every input answered every request 500
while /healthz stayed 200, and nothing was logged."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

import pytest
import torch

from app.buffers import BufferPool
from app.compute_slots import ComputeSlots
from app.embedding_service import NonFiniteOutput
from app.engine.client import failure_error
from app.engine.core import EngineCore
from app.engine.health import BatchHealth
from app.engine.protocol import EmbedPayload, Failure, FailureKind, FromEngine, Submit
from app.metrics import Metrics
from app.model_batcher import ModelBatcher
from app.scheduler import BatchPolicy
from tests.support.fake_model import GatedLoader
from tests.support.inline_batching import InlineDispatcher
from tests.support.stand_in_engine import final_answer, stand_in_settings

THRESHOLD = 2
SETTINGS = stand_in_settings("a", unhealthy_after_failed_batches=THRESHOLD)
NAN_TOKEN = 13  # an input starting with it computes NaN (`NanRunner`)
MESSAGE = "a produced a non-finite value (NaN or infinity)"  # the front end's, as it was


def nan_forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return torch.full((input_ids.shape[0], 4), float("nan"))


@pytest.fixture
async def loaded() -> AsyncIterator[tuple[EngineCore, GatedLoader]]:
    loader = GatedLoader()
    core = EngineCore(SETTINGS, Metrics(), loader=loader)
    await core.start()
    assert core.ready
    try:
        yield core, loader
    finally:
        await core.stop()


async def answer(core: EngineCore, request_id: int) -> FromEngine:
    request = Submit(request_id, "a", time.monotonic() + 30, EmbedPayload([[1, 5, 2]]))
    return await final_answer(core, request)


async def test_a_model_computing_nan_for_every_input_turns_the_engine_unhealthy(
    loaded: tuple[EngineCore, GatedLoader], caplog: pytest.LogCaptureFixture
) -> None:
    core, loader = loaded
    loader.runners["a"].forward = nan_forward  # type: ignore[method-assign]
    caplog.set_level(logging.ERROR)
    for request_id in range(THRESHOLD):
        failed = await answer(core, request_id)
        assert isinstance(failed, Failure) and failed.kind is FailureKind.FAILED
        assert failed.reason == "non_finite_output"
        # The front end raises what it raised for it before: the same 500 body.
        error = failure_error(failed)
        assert isinstance(error, NonFiniteOutput) and str(error) == MESSAGE
    status = core.status()
    assert not status.healthy
    assert status.problem == "model 'a': 2 consecutive batches failed (NonFiniteOutput)"
    logged = [r for r in caplog.records if "non-finite output" in r.getMessage()]
    assert len(logged) == THRESHOLD  # once a batch
    assert all(r.levelno == logging.ERROR and "a:" in r.getMessage() for r in logged)


class NanRunner:
    """Each row's output is its tokens' sum, NaN for a row starting with `NAN_TOKEN`; with
    `fails_batches`, a batch of more than one real row raises (an input's fault, triaged)."""

    name = "a"
    task = "embed"
    device = torch.device("cpu")
    dtype = torch.float32
    max_input_tokens = 16
    output_width = 2
    pad_token_id = 0

    def __init__(self, fails_batches: bool = False) -> None:
        self.fails_batches = fails_batches

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        real = int((attention_mask.sum(dim=1) > 1).sum())
        if self.fails_batches and real > 1:
            raise ValueError("the model throws on this batch")
        sums = (input_ids * attention_mask).sum(dim=1).float()
        sums[input_ids[:, 0] == NAN_TOKEN] = float("nan")
        return torch.stack([sums, attention_mask.sum(dim=1).float()], dim=1)


class Dispatcher(InlineDispatcher):
    def stream(self) -> None:
        return None


def batcher_of(runner: NanRunner, health: BatchHealth) -> ModelBatcher:
    policy = BatchPolicy(length_buckets=(8,), max_batch_size=4, max_batch_tokens=64, max_wait_s=0)
    pool = BufferPool(policy.shapes(), runner.output_width, runner.device, 1)
    return ModelBatcher(
        runner,  # type: ignore[arg-type]
        policy,
        pool,
        Dispatcher(),  # type: ignore[arg-type]
        ComputeSlots(1),
        Metrics(),
        lambda: 0.0,
        health.recorder("a"),
    )


async def answers(batcher: ModelBatcher, requests: Sequence[list[list[int]]]) -> list[object]:
    """Each request's first row's value, or what it raised; all queued before the batch
    loop starts, so that they share its first batch."""
    futures = [batcher.submit(rows, deadline=10.0)[0] for rows in requests]
    batcher.start()
    results = await asyncio.gather(*futures, return_exceptions=True)
    await batcher.close()
    return [r if isinstance(r, BaseException) else r.value.tolist() for r in results]


@pytest.mark.parametrize("fails_batches", [False, True], ids=["batch", "row-alone"])
async def test_only_the_non_finite_rows_fail_and_one_input_is_no_strike(
    fails_batches: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The row computing NaN fails 500 `non_finite_output`, the other row of its batch is
    answered; in a batch that computed, and in a failed batch's rows run alone (`triage`).
    The model answered another row: no strike toward /healthz, or a client resending an
    input that overflows would have the pod restarted."""
    health = BatchHealth(threshold=5)
    runner = NanRunner(fails_batches)
    caplog.set_level(logging.ERROR)
    good, bad = await answers(batcher_of(runner, health), [[[1, 5, 2]], [[NAN_TOKEN, 2]]])
    assert good == [8.0, 3.0]
    assert isinstance(bad, NonFiniteOutput) and str(bad) == MESSAGE
    assert health.consecutive_failures == 0
    logged = [r for r in caplog.records if "non-finite output" in r.getMessage()]
    assert len(logged) == 1
