"""What the engine answers an `embed` payload it cannot serve as sent: `BAD_REQUEST` (a 400),
never a 500 nor a 429 its client retries. Front ends never send these (they refuse empty
texts, and inputs over the largest bucket); one misbehaving, or of another version, may.
A real `EngineCore` over the stand-in model (`tests/support/fake_model.py`), warm-up off,
its batches held back by a minute's `max_wait_ms`, so what is queued stays queued."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from app.engine.core import EngineCore
from app.engine.protocol import EmbedPayload, Failure, FailureKind, FromEngine, Submit
from app.metrics import Metrics
from app.model_specs import ModelSpec
from app.settings import Settings
from tests.support.fake_model import GatedLoader

ORIGIN = b"front-end"
SETTINGS = Settings(
    models=(ModelSpec(name="m", source="unused"),),
    length_buckets=(16, 32),
    max_queue=2,
    max_inputs_per_request=2,
    max_wait_ms=60_000,
    warmup=False,
    spike_reports=False,
    dispatcher_threads=1,
    torch_threads=1,
)


@pytest.fixture
async def core() -> AsyncIterator[EngineCore]:
    core = EngineCore(SETTINGS, Metrics(), loader=GatedLoader())
    await core.start()
    assert core.ready
    try:
        yield core
    finally:
        for origin, request_id in list(core._requests):
            core.cancel(origin, request_id)  # else `stop` waits out their minute
        await core.stop()


def submit(core: EngineCore, request_id: int, token_ids: list[list[int]]) -> list[FromEngine]:
    answers: list[FromEngine] = []
    request = Submit(request_id, "m", time.monotonic() + 60, EmbedPayload(token_ids))
    core.submit(ORIGIN, request, answers.append)
    return answers


@pytest.mark.parametrize(
    ("token_ids", "problem"),
    [
        ([], "no inputs: token_ids is empty"),
        ([[]], "input 0 has no tokens"),
        ([[1, 5, 2], []], "input 1 has no tokens"),
    ],
    ids=["no-inputs", "an-empty-input", "an-empty-input-beside-another"],
)
async def test_no_inputs_or_an_input_of_no_tokens_is_a_bad_request(
    core: EngineCore, token_ids: list[list[int]], problem: str
) -> None:
    """No inputs raised `ValueError` in admission (the longest of none): a 500 from the
    engine process, and an error out of `submit` in process. An input of no tokens was
    queued, its attention mask all zeros (which some kernels turn into NaN)."""
    answers = submit(core, 1, token_ids)
    assert answers == [Failure(1, FailureKind.BAD_REQUEST, problem)]
    assert core.queued_inputs() == 0 and not core._requests


async def test_an_input_over_the_largest_bucket_is_a_bad_request_however_full_the_queue(
    core: EngineCore,
) -> None:
    """With the queue at its cap it was refused 429 `queue` first: its client retried,
    again and again, what the engine can never serve."""
    assert submit(core, 1, [[1, 5, 2], [1, 4, 2]]) == []  # queued: the queue is at its cap
    assert core.queued_inputs() == 2
    [refused] = submit(core, 2, [[1, 5, 2]])
    assert isinstance(refused, Failure) and refused.kind is FailureKind.REJECTED  # the cap
    [failure] = submit(core, 3, [[1] * 40])
    assert isinstance(failure, Failure) and failure.kind is FailureKind.BAD_REQUEST
    assert failure.message == "40 tokens exceed the largest length bucket"
    assert core.queued_inputs() == 2
