"""A generate model's published queue is its wait as the engine's own generation admission
computes it: the wait for a KV-cache slot included, and its cap on waiting sequences
(`generate_max_waiting`). Left out, a front end judged a saturated KV cache idle, and
/v1/completions and chat were never refused before the body (/infer neither, judged on
any model): every request had its body read and tokenized, to be refused by the engine.

An in-process engine over the tiny causal LM, warm-up off; its sequence table is filled by
hand (nothing awaits meanwhile, so its step loop does not run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.admission import Rejected, RejectReason
from app.engine.generation_host import GenerationHost
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import (
    PROTOCOL_CLOCK,
    Failure,
    FromEngine,
    GeneratePayload,
    SamplingParams,
    Submit,
)
from app.main import SHED_PATHS
from app.model_queues import shed_verdict
from tests.support.generation_engine import settings_for, started
from tests.support.stand_in_sequence import stand_in_sequence as sequence

BUDGET_S = 0.100
COMPLETIONS = SHED_PATHS["/v1/completions"]


async def saturated(engine: InProcessEngine, step_s: float) -> GenerationHost:
    """Its one KV-cache slot held by a sequence with 200 tokens to go, one more waiting
    for it (50 tokens); a step measured at `step_s`."""
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    table = host._batch
    table.queue(sequence(200))
    table.join(max_batch_tokens=64, now=0.0)
    table.queue(sequence(50))
    host._step_s = step_s
    return host


def engine_verdict(engine: InProcessEngine) -> FromEngine:
    request = Submit(
        1000,
        "tiny",
        PROTOCOL_CLOCK() + 30.0,
        GeneratePayload([1, 7], SamplingParams(max_new_tokens=4)),
    )
    answers: list[FromEngine] = []
    engine.core.submit(b"fe", request, answers.append)
    [answer] = answers  # refused at once
    return answer


async def test_a_saturated_kv_cache_is_refused_before_the_body(tiny_causal_lm: Path) -> None:
    settings = settings_for(
        tiny_causal_lm, warmup=False, generate_slots=1, max_queue_delay_ms=BUDGET_S * 1000
    )
    engine = await started(settings)
    host = await saturated(engine, step_s=0.002)
    try:
        # A sequence queued now starts once both end: 250 steps of 2 ms.
        refused = engine_verdict(engine)
        assert isinstance(refused, Failure) and refused.reason == RejectReason.QUEUE.value
        assert "predicted wait 500 ms" in refused.message
        status = engine.core.status()
        now = PROTOCOL_CLOCK()
        verdict = shed_verdict(status, 0, now + 30.0, now, BUDGET_S, task=COMPLETIONS)
        assert isinstance(verdict, Rejected), "was let in: the KV cache's wait was left out"
        assert verdict.reason is RejectReason.QUEUE
        assert "predicted wait 500 ms" in verdict.message
        assert verdict.retry_after_s == pytest.approx(refused.retry_after_s)
        assert status.backlog_s == 0.0  # the whole engine's: other models do not wait for it
    finally:
        for waiting in host._batch.everyone():
            host._batch.remove(waiting)
        await engine.close()


async def test_a_model_at_its_cap_of_waiting_sequences_is_refused_before_the_body(
    tiny_causal_lm: Path,
) -> None:
    """No step measured (warm-up off): no wait predicted, but `generate_max_waiting` (1)
    sequences wait, so the engine refuses every new one; front ends now refuse it too."""
    settings = settings_for(
        tiny_causal_lm,
        warmup=False,
        generate_slots=1,
        generate_max_waiting=1,
        max_queue_delay_ms=BUDGET_S * 1000,
    )
    engine = await started(settings)
    host = await saturated(engine, step_s=0.0)
    try:
        refused = engine_verdict(engine)
        assert isinstance(refused, Failure) and refused.reason == RejectReason.QUEUE.value
        assert "cap generate_max_waiting=1" in refused.message
        now = PROTOCOL_CLOCK()
        status = engine.core.status()
        for task in (COMPLETIONS, SHED_PATHS["/infer"]):
            verdict = shed_verdict(status, 0, now + 30.0, now, BUDGET_S, task=task)
            assert isinstance(verdict, Rejected), f"{task}: let in, to be refused after its body"
            assert verdict.reason is RejectReason.QUEUE
            assert verdict.retry_after_s == refused.retry_after_s == 1.0  # unknown: 1 s
        named = shed_verdict(status, 0, now + 30.0, now, BUDGET_S, model="tiny")
        assert isinstance(named, Rejected) and "'tiny'" in named.message
    finally:
        for waiting in host._batch.everyone():
            host._batch.remove(waiting)
        await engine.close()
