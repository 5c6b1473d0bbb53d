"""Prefix reuse (`generate_prefix_reuse`), with the tiny random-weight causal LM through the
engine protocol: a prompt sharing a long prefix with what a free slot holds starts past it,
and its greedy tokens are still `model.generate`'s; what a slot holds after a multi-step run
(its length or a stop token), and after a cancel mid-prefill, is exactly what its steps
wrote (a request reusing all of it gets the reference tokens); a slot zeroed after
non-finite logits is not reused. Before prefix reuse every prompt was prefilled whole and
the reused-tokens metric did not exist: every test here fails there."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel

from app.engine.generation_host import GenerationHost
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import SamplingParams
from app.failures import BatchFailed
from app.models.causal_lm import StepRow
from loadtest.tiny_causal_lm import CORPUS
from tests.support.generation_engine import (
    expected_greedy,
    generate,
    settings_for,
    started,
    submit,
)
from tests.support.held_step import held_step

pytestmark = pytest.mark.asyncio(loop_scope="module")

REUSED = "steadyserve_generate_prefix_reused_tokens_total"


def corpus_ids(tokenizer: AutoTokenizer) -> list[int]:
    ids: list[int] = tokenizer(" ".join(CORPUS))["input_ids"]
    assert len(ids) > 120
    return ids


async def engine_with(source: Path, **overrides: object) -> tuple[InProcessEngine, GenerationHost]:
    engine = await started(settings_for(source, warmup=False, **overrides))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    return engine, host


def reused(engine: InProcessEngine) -> float:
    registry = engine.core.metrics.registry
    return registry.get_sample_value(REUSED, {"model": "tiny"}) or 0.0


def record_prefill_starts(host: GenerationHost) -> list[tuple[int, int]]:
    """Each prompt row's (start, tokens fed), in the order they ran."""
    rows_seen: list[tuple[int, int]] = []
    real = host.runner.step

    def recording(rows: Sequence[StepRow]) -> list[int]:
        rows_seen.extend((row.start, len(row.token_ids)) for row in rows if row.prefill)
        return real(rows)

    host.runner.step = recording  # type: ignore[method-assign]
    return rows_seen


@pytest.mark.parametrize("reuse", [True, False])
async def test_a_shared_prefix_is_reused_and_greedy_equals_generate(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel], reuse: bool
) -> None:
    tokenizer, model = reference
    ids = corpus_ids(tokenizer)
    prefix = ids[:40]
    first, second = [*prefix, *ids[60:70]], [*prefix, *ids[80:87]]
    assert first[40] != second[40]
    engine, host = await engine_with(tiny_causal_lm, generate_prefix_reuse=reuse)
    try:
        a = await generate(engine, first, SamplingParams(max_new_tokens=6))
        before = reused(engine)
        starts = record_prefill_starts(host)
        b = await generate(engine, second, SamplingParams(max_new_tokens=8))
    finally:
        await engine.close()
    assert a.token_ids == expected_greedy(model, first, 6).token_ids
    assert b.token_ids == expected_greedy(model, second, 8).token_ids
    assert b.prompt_tokens == len(second)  # every prompt token is reported, reused or not
    if reuse:
        assert starts == [(40, 7)] and reused(engine) == before + 40
    else:
        assert starts == [(0, 47)] and reused(engine) == before == 0


async def test_a_multi_step_run_leaves_exactly_the_tokens_it_fed(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """Runs of 8 steps: a sequence ending at its length leaves its prompt and every token
    but its last; one ending at a stop token leaves every kept token (the stop token was
    never fed). A prompt extending all of it reuses all of it and still gets the reference
    tokens (a token counted resident that was never written would change them)."""
    tokenizer, model = reference
    ids = corpus_ids(tokenizer)
    prompt = ids[:30]
    reference_tokens = expected_greedy(model, prompt, 12).token_ids
    assert len(reference_tokens) == 12, "the premise: no EOS in these"
    stop = reference_tokens[9]
    assert stop not in reference_tokens[:9], "the premise: the first stop is the 10th"
    engine, host = await engine_with(tiny_causal_lm, generate_steps_per_dispatch=8)
    slots = host._batch.slots
    try:
        at_length = await generate(engine, prompt, SamplingParams(max_new_tokens=11))
        assert at_length.token_ids == reference_tokens[:11]
        assert slots.resident(0) == (*prompt, *reference_tokens[:10])
        # The next one extends it all: it reuses all 40 and feeds the 11th token and one more.
        longer = [*prompt, *reference_tokens[:11], ids[100]]
        before = reused(engine)
        extended = await generate(engine, longer, SamplingParams(max_new_tokens=5))
        assert extended.token_ids == expected_greedy(model, longer, 5).token_ids
        assert reused(engine) == before + 40
        stopped = await generate(
            engine, prompt, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,))
        )
        assert stopped.token_ids == reference_tokens[:9]
        assert slots.resident(0) == (*prompt, *reference_tokens[:9])
        after_stop = [*prompt, *reference_tokens[:9], stop, ids[101]]
        before = reused(engine)
        resumed = await generate(engine, after_stop, SamplingParams(max_new_tokens=5))
        assert resumed.token_ids == expected_greedy(model, after_stop, 5).token_ids
        assert reused(engine) == before + 39
    finally:
        await engine.close()


async def test_a_cancel_mid_prefill_leaves_the_chunks_its_steps_wrote(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """One slot, chunks of 8: a 60-token prompt is cancelled while its second chunk
    computes; that chunk is written all the same, so the slot holds 16 of its tokens, and
    a prompt sharing 30 of them reuses those 16 and gets the reference tokens."""
    tokenizer, model = reference
    ids = corpus_ids(tokenizer)
    long_prompt = ids[:60]
    engine, host = await engine_with(
        tiny_causal_lm, generate_slots=1, generate_prefill_chunk_tokens=8
    )
    slots = host._batch.slots
    try:
        with held_step(host.runner, at=2) as second_chunk:
            request = submit(engine, long_prompt, SamplingParams(max_new_tokens=5))
            engine.core.submit(b"front", request, lambda message: None)
            assert await asyncio.to_thread(second_chunk.reached.wait, 60)
            engine.core.cancel(b"front", request.request_id)
            for _ in range(1000):
                if slots.free == 1:
                    break
                await asyncio.sleep(0)
            assert slots.resident(0) == tuple(long_prompt[:8])  # its taken chunk, so far
            second_chunk.release()
            for _ in range(1000):
                if slots.resident(0) != tuple(long_prompt[:8]):
                    break
                await asyncio.sleep(0.01)
        assert slots.resident(0) == tuple(long_prompt[:16])  # and the one computing then
        sharing = [*long_prompt[:30], *ids[90:95]]
        before = reused(engine)
        result = await generate(engine, sharing, SamplingParams(max_new_tokens=6))
        assert result.token_ids == expected_greedy(model, sharing, 6).token_ids
        assert reused(engine) == before + 16
    finally:
        await engine.close()


async def test_a_slot_zeroed_after_non_finite_logits_is_not_reused(
    tiny_causal_lm: Path,
    reference: tuple[AutoTokenizer, PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sequence whose logits turn NaN at its first decode step fails and its slot is
    zeroed: the 30 prompt tokens it computed there are no longer resident, and the same
    prompt sent again is prefilled whole (reusing zeros would change its tokens)."""
    tokenizer, model = reference
    prompt = corpus_ids(tokenizer)[:30]
    engine, host = await engine_with(tiny_causal_lm, generate_slots=1)
    logits = host.runner.logits
    broken: list[int] = []

    def overflowing(rows: Sequence[StepRow]) -> torch.Tensor:
        computed = logits(rows).clone()
        if not broken and not rows[0].prefill:
            broken.append(rows[0].slot)
            computed[0] = float("nan")
        return computed

    monkeypatch.setattr(host.runner, "logits", overflowing)
    try:
        with pytest.raises(BatchFailed, match="not finite"):
            await generate(engine, prompt, SamplingParams(max_new_tokens=4))
        assert broken == [0] and host._batch.slots.resident(0) == ()
        before = reused(engine)
        again = await generate(engine, prompt, SamplingParams(max_new_tokens=4))
        assert again.token_ids == expected_greedy(model, prompt, 4).token_ids
        assert reused(engine) == before
    finally:
        await engine.close()


async def test_a_failed_step_s_slots_hold_nothing_reusable(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """A step that raises while a joiner prefills past the 40 tokens it reuses is triaged:
    the joiner runs again over its reused tokens (its slot not zeroed) and gets the reference
    tokens; but what its slot holds after is not trusted (the failed step may have written
    anything past them): a third prompt sharing the prefix is prefilled whole."""
    tokenizer, model = reference
    ids = corpus_ids(tokenizer)
    prefix = ids[:40]
    first, second, third = ([*prefix, *ids[start : start + 6]] for start in (60, 80, 100))
    engine, host = await engine_with(tiny_causal_lm, generate_slots=1)
    real_step = host.runner.step
    failed: list[int] = []

    def failing_once(rows: Sequence[StepRow]) -> list[int]:
        if not failed and any(row.prefill and row.start == 40 for row in rows):
            failed.append(len(rows))
            raise RuntimeError("injected")
        return real_step(rows)

    host.runner.step = failing_once  # type: ignore[method-assign]
    try:
        await generate(engine, first, SamplingParams(max_new_tokens=4))
        before = reused(engine)
        b = await generate(engine, second, SamplingParams(max_new_tokens=6))
        assert failed == [1] and reused(engine) == before + 40
        assert b.token_ids == expected_greedy(model, second, 6).token_ids
        assert host._batch.slots.resident(0) == ()
        c = await generate(engine, third, SamplingParams(max_new_tokens=6))
        assert c.token_ids == expected_greedy(model, third, 6).token_ids
        assert reused(engine) == before + 40
    finally:
        await engine.close()


async def test_reused_tokens_count_only_once_a_step_ran_on_them(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """A joiner reusing 40 tokens whose step fails, and fails again when triage reruns it
    alone, is failed: no step ran on what it reused, so the counter does not move (it
    counted at join, whatever happened next)."""
    tokenizer, _ = reference
    ids = corpus_ids(tokenizer)
    first, second = ([*ids[:40], *ids[start : start + 6]] for start in (60, 80))
    engine, host = await engine_with(tiny_causal_lm, generate_slots=1)
    real_step = host.runner.step

    def failing_past_the_prefix(rows: Sequence[StepRow]) -> list[int]:
        if any(row.prefill and row.start == 40 for row in rows):
            raise RuntimeError("injected")
        return real_step(rows)

    try:
        await generate(engine, first, SamplingParams(max_new_tokens=4))
        host.runner.step = failing_past_the_prefix  # type: ignore[method-assign]
        before = reused(engine)
        with pytest.raises(BatchFailed):
            await generate(engine, second, SamplingParams(max_new_tokens=6))
        assert reused(engine) == before
    finally:
        await engine.close()
