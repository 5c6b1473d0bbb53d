"""A row whose logits are not finite (a model overflowing its dtype: a bf16-trained model in
fp16 gives NaN) fails its sequence, after the tokens it had, with a 500 logged under the
model's name; the sequence beside it is unaffected. Greedy argmax took token 0 of an all-NaN
row: the sequence emitted token 0 until max_new_tokens, with no error."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel

from app.engine.generation_host import GenerationHost
from app.engine.protocol import GeneratePayload, SamplingParams, Submit, TokensOutput
from app.failures import BatchFailed
from app.models.causal_lm import StepRow
from tests.support.generation_engine import (
    collect,
    expected_greedy,
    generate,
    settings_for,
    started,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

BROKEN_PROMPT = [1, *range(100, 112)]  # 13 tokens
BESIDE_PROMPT = [1, 40, 41]
GOOD_TOKENS = 3  # the broken sequence's logits turn NaN from its 4th token on


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("steps_per_dispatch", [1, 8])
async def test_a_row_with_nan_logits_fails_its_sequence_alone(
    tiny_causal_lm: Path,
    reference: tuple[AutoTokenizer, PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    steps_per_dispatch: int,
    sampled: bool,
) -> None:
    _, model = reference
    good = expected_greedy(model, BROKEN_PROMPT, GOOD_TOKENS).token_ids
    beside = expected_greedy(model, BESIDE_PROMPT, 8).token_ids
    assert len(good) == GOOD_TOKENS and len(beside) == 8, "the premise: no EOS in these"
    engine = await started(
        settings_for(tiny_causal_lm, warmup=False, generate_steps_per_dispatch=steps_per_dispatch)
    )
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    logits = host.runner.logits
    # Positions past the broken prompt + its good tokens: BESIDE_PROMPT's 3 + 8 never reach.
    broken_from = len(BROKEN_PROMPT) + GOOD_TOKENS - 1

    def overflowing(rows: Sequence[StepRow]) -> torch.Tensor:
        computed = logits(rows).clone()
        for index, row in enumerate(rows):
            if row.start + len(row.token_ids) > broken_from:
                computed[index] = float("nan")
        return computed

    monkeypatch.setattr(host.runner, "logits", overflowing)
    sampling = SamplingParams(max_new_tokens=12, do_sample=sampled, top_k=1, seed=1)
    request = Submit(
        engine.next_request_id(),
        "tiny",
        time.monotonic() + 60,
        GeneratePayload(BROKEN_PROMPT, sampling, stream=True),
    )
    received: list[int] = []

    async def broken() -> None:
        with pytest.raises(BatchFailed, match="not finite"):
            async for output in engine.stream(request):
                assert isinstance(output.payload, TokensOutput)
                received.extend(output.payload.token_ids)

    caplog.set_level(logging.ERROR, logger="app.engine.generation_host")
    try:  # side by side: the two share their steps
        _, healthy = await asyncio.gather(
            broken(), generate(engine, BESIDE_PROMPT, SamplingParams(max_new_tokens=8))
        )
    finally:
        await engine.close()
    assert received == good  # its tokens before the breakdown, then the failure
    assert healthy.token_ids == beside
    assert "tiny: non-finite logits" in caplog.text


SHORT_PROMPT = [1, 44, 45]  # the next occupant of the broken one's slot


def slot_premise(model: PreTrainedModel) -> tuple[list[int], list[int]]:
    """The greedy tokens of the long sequence beside (40) and of the next occupant (6)."""
    long_tokens = expected_greedy(model, BESIDE_PROMPT, 40).token_ids
    short_tokens = expected_greedy(model, SHORT_PROMPT, 6).token_ids
    assert len(long_tokens) == 40 and len(short_tokens) == 6, "the premise: no EOS in these"
    return long_tokens, short_tokens


def poison_the_broken_slot(
    host: GenerationHost,
    monkeypatch: pytest.MonkeyPatch,
    then: Callable[[], None] = lambda: None,
) -> None:
    """At the broken prompt's first decode step, its logits are NaN and so are its slot's
    keys and values in every layer (its activations overflowed); `then` runs after, on
    the compute thread, within that step."""
    logits, cache = host.runner.logits, host.runner.cache
    broken: dict[str, int] = {}  # the broken sequence's slot, once it prefilled

    def overflowing(rows: Sequence[StepRow]) -> torch.Tensor:
        computed = logits(rows).clone()
        for index, row in enumerate(rows):
            if list(row.token_ids) == BROKEN_PROMPT:
                broken["slot"] = row.slot
            elif row.slot == broken.get("slot") and "poisoned" not in broken:
                computed[index] = float("nan")
                for layer in cache.layers:
                    layer.keys[row.slot].fill_(float("nan"))  # type: ignore[index]
                    layer.values[row.slot].fill_(float("nan"))  # type: ignore[index]
                broken["poisoned"] = 1
                then()
        return computed

    monkeypatch.setattr(host.runner, "logits", overflowing)


async def test_the_slot_of_a_sequence_with_nan_logits_is_zeroed_for_its_next_occupant(
    tiny_causal_lm: Path,
    reference: tuple[AutoTokenizer, PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sequence whose activations overflow leaves NaN keys and values in its slot. Stale
    entries are masked, but a mask is added to a score and NaN stays NaN: the slot's next
    occupant, decoding beside a longer sequence (so attending past its own length), got
    NaN logits too, and failed, as would every later occupant of that slot."""
    long_tokens, short_tokens = slot_premise(reference[1])
    engine = await started(settings_for(tiny_causal_lm, warmup=False, generate_slots=2))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    poison_the_broken_slot(host, monkeypatch)
    try:
        long_one = asyncio.create_task(
            generate(engine, BESIDE_PROMPT, SamplingParams(max_new_tokens=40))
        )
        with pytest.raises(BatchFailed, match="not finite"):
            await generate(engine, BROKEN_PROMPT, SamplingParams(max_new_tokens=12))
        assert not long_one.done(), "the premise: the long one still runs beside the next"
        short = await generate(engine, SHORT_PROMPT, SamplingParams(max_new_tokens=6))
        long_done = await long_one
    finally:
        await engine.close()
    assert short.token_ids == short_tokens  # in the broken one's slot, beside the long one
    assert long_done.token_ids == long_tokens


async def test_a_sequence_cancelled_in_the_step_its_logits_broke_still_has_its_slot_zeroed(
    tiny_causal_lm: Path,
    reference: tuple[AutoTokenizer, PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client of a sequence whose activations overflow goes away (or its front end stops
    it at a stop string) while that step computes: the cancel frees its slot at once, and
    the step's result, read after, skipped the dropped sequence before seeing its NaN. The
    slot went back to the free list with NaN keys and values, and its next occupant,
    decoding beside a longer sequence, failed with "not finite"."""
    long_tokens, short_tokens = slot_premise(reference[1])
    engine = await started(settings_for(tiny_causal_lm, warmup=False, generate_slots=2))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    loop = asyncio.get_running_loop()
    broken_request = Submit(
        engine.next_request_id(),
        "tiny",
        time.monotonic() + 60,
        GeneratePayload(BROKEN_PROMPT, SamplingParams(max_new_tokens=12), stream=True),
    )
    cancelled = asyncio.Event()

    def cancel_broken() -> None:  # the loop thread: as a front end's Cancel arrives
        engine.core.cancel(engine.origin, broken_request.request_id)
        cancelled.set()

    # Queued on the loop from within the poisoned step, before its result is: read first.
    poison_the_broken_slot(host, monkeypatch, lambda: loop.call_soon_threadsafe(cancel_broken))
    try:
        long_one = asyncio.create_task(
            generate(engine, BESIDE_PROMPT, SamplingParams(max_new_tokens=40))
        )
        broken_one = asyncio.create_task(collect(engine.stream(broken_request)))
        await cancelled.wait()
        broken_one.cancel()  # its engine answers no more: the client is gone
        await asyncio.gather(broken_one, return_exceptions=True)
        assert not long_one.done(), "the premise: the long one still runs beside the next"
        short = await generate(engine, SHORT_PROMPT, SamplingParams(max_new_tokens=6))
        long_done = await long_one
    finally:
        await engine.close()
    assert short.token_ids == short_tokens  # in the broken one's slot, beside the long one
    assert long_done.token_ids == long_tokens


async def test_a_non_final_chunk_with_nan_logits_fails_its_sequence_and_zeroes_its_slot(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prefill, chunks of 8: the second chunk of a 30-token prompt computes NaN
    logits. A non-final chunk chooses no token, so nothing looked at them: the sequence went
    on (and one that left before its last chunk left what broke them in a free slot, for the
    next occupant). Now it fails (500) at that chunk and its slot is zeroed."""
    settings = settings_for(tiny_causal_lm, warmup=False, generate_prefill_chunk_tokens=8)
    engine = await started(settings)
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    logits = host.runner.logits

    def overflowing(rows: Sequence[StepRow]) -> torch.Tensor:
        computed = logits(rows).clone()
        for index, row in enumerate(rows):
            if row.prefill and row.start == 8:
                computed[index] = float("nan")
        return computed

    cleared: list[int] = []
    clear_slot: Callable[[int], None] = host.runner.cache.clear_slot

    def recording_clear(slot: int) -> None:
        cleared.append(slot)
        clear_slot(slot)

    monkeypatch.setattr(host.runner, "logits", overflowing)
    monkeypatch.setattr(host.runner.cache, "clear_slot", recording_clear)
    try:
        request = Submit(
            engine.next_request_id(),
            "tiny",
            time.monotonic() + 60,
            GeneratePayload(list(range(3, 33)), SamplingParams(max_new_tokens=4)),
        )
        with pytest.raises(BatchFailed, match="not finite"):
            await collect(engine.stream(request))
        after = await generate(engine, [1, 40, 41], SamplingParams(max_new_tokens=2))
        assert after.token_ids  # the next forward ran: the slot was zeroed before it
        assert cleared, "the broken chunk's slot was not zeroed"
    finally:
        await engine.close()
