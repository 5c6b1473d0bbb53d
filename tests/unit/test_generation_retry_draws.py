"""A sampled sequence whose step fails and is run again (`generation_triage.py`) draws what
it would have drawn without the failure: a seeded request gives the same tokens. The failed
dispatch had already drawn from the sequence's generator (a multi-step run's first step, or
a joiner's prefill before the decode forward raised), so the rerun drew the next number
instead, and a seeded request's sample depended on a failure it never saw. The tiny model
in-process, its `step` failing once, as tests/unit/test_generation_step_triage.py fails it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from app.engine.generation_host import GenerationHost
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import SamplingParams
from app.models.causal_lm import StepRow
from tests.support.generation_engine import collect, generate, settings_for, started, submit

DECODING = [1, 40, 41]
JOINER = [1, 44, 45]
SAMPLED = SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.5, seed=7)
JOINER_SAMPLED = SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.5, seed=11)

Call = list[tuple[tuple[int, ...], int]]  # a forward's rows: (prompt or last token, start)
FailsAt = Callable[[list[Call]], bool]  # the forwards so far, the last one this one


def failing_once(host: GenerationHost, monkeypatch: pytest.MonkeyPatch, at: FailsAt) -> list[Call]:
    """The model's step raises once, at the first forward `at` names (before computing it);
    returns every forward's rows, in order."""
    real = host.runner.step
    calls: list[Call] = []
    failed: list[bool] = []

    def step(rows: Sequence[StepRow]) -> list[int]:
        calls.append([(tuple(row.token_ids), row.start) for row in rows])
        if not failed and at(calls):
            failed.append(True)
            raise RuntimeError("this forward fails once")
        return real(rows)

    monkeypatch.setattr(host.runner, "step", step)
    return calls


async def tiny_engine(
    tiny_causal_lm: Path, **settings: object
) -> tuple[InProcessEngine, GenerationHost]:
    engine = await started(settings_for(tiny_causal_lm, warmup=False, **settings))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    return engine, host


@pytest.mark.parametrize("stream", [True, False])
async def test_a_multi_step_run_failing_after_its_first_draw_reruns_that_draw(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The run's second forward fails: its first step had drawn (and was handed over), and
    the rerun of the failed step (the triage's known-good decode row) must draw what it
    would have: the generator as the failed step found it, not as the run did, nor as the
    failed step left it. A sequence that does not stream gets a run's tokens as it ends:
    those of the steps before the failure must still reach it."""
    engine, host = await tiny_engine(tiny_causal_lm, generate_steps_per_dispatch=4)
    try:
        unfailed = (await generate(engine, DECODING, SAMPLED, stream)).token_ids
        calls = failing_once(host, monkeypatch, lambda calls: len(calls) == 3)
        retried = (await generate(engine, DECODING, SAMPLED, stream)).token_ids
    finally:
        await engine.close()
    # The premise: a prefill, then a run whose second step failed and was run again.
    assert calls[0] == [(tuple(DECODING), 0)] and calls[1][0][1] > 0
    assert calls[2][0][1] == calls[1][0][1] + 1
    assert calls[3] == calls[2], "the rerun is the failed step"
    assert len(unfailed) == 12
    assert retried == unfailed


async def test_a_joiner_whose_prefill_drew_before_the_step_failed_draws_it_again(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step: the joiner's prefill drew, then the decode forward beside it raised; the
    triage prefilled the joiner alone, which drew the next number instead."""
    engine, host = await tiny_engine(tiny_causal_lm)

    def decode_after_joiner(calls: list[Call]) -> bool:
        return len(calls) > 1 and calls[-2] == [(tuple(JOINER), 0)] and calls[-1][0][1] > 0

    try:
        decoding = (await generate(engine, DECODING, SAMPLED)).token_ids
        joiner = (await generate(engine, JOINER, JOINER_SAMPLED)).token_ids
        calls = failing_once(host, monkeypatch, decode_after_joiner)
        stream = engine.stream(submit(engine, DECODING, SAMPLED))
        first = await anext(stream)  # the joiner joins a step in which DECODING decodes
        joined = asyncio.create_task(collect(engine.stream(submit(engine, JOINER, JOINER_SAMPLED))))
        rest = await collect(stream)
        joined_tokens = (await joined).token_ids
    finally:
        await engine.close()
    failed_at = next(i for i in range(1, len(calls)) if decode_after_joiner(calls[: i + 1]))
    assert calls[failed_at + 2] == [(tuple(JOINER), 0)], "the premise: prefilled alone again"
    assert [*first.payload.token_ids, *rest.token_ids] == decoding  # type: ignore[union-attr]
    assert joined_tokens == joiner
