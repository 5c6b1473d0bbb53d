"""The `generate` task's results through the engine protocol, with the tiny random-weight
causal LM, on one engine this module shares: greedy results equal `model.generate` one
prompt at a time, while 20 sequences of different lengths join and leave a running batch
of 8 slots; whole (unstreamed) answers; warm-up; the length ending; oversized requests;
seeded sampling; an embedding model served beside a generation model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from transformers import AutoTokenizer, PreTrainedModel

from app.engine.client import EngineRefused
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import EmbedOutput, EmbedPayload, FinishReason, SamplingParams, Submit
from app.model_specs import ModelSpec
from loadtest.tiny_causal_lm import CORPUS
from tests.support.generation_engine import (
    SLOT_TOKENS,
    expected_greedy,
    generate,
    settings_for,
    started,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [
    text[:cut] for text in CORPUS for cut in (12, 200) if len(text) > 12
]  # 20 prompts, 4 to 30 tokens


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_causal_lm: Path) -> AsyncIterator[InProcessEngine]:
    engine = await started(settings_for(tiny_causal_lm))
    yield engine
    await engine.close()


async def test_greedy_equals_generate_one_prompt_at_a_time(
    engine: InProcessEngine, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    tokenizer, model = reference
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    assert len(prompts) >= 16 and len({len(p) for p in prompts}) >= 8
    lengths = [8 + (index * 7) % 25 for index in range(len(prompts))]
    cache = engine.core.hosts["tiny"].runner.cache  # type: ignore[attr-defined]
    storage = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    registry = engine.core.metrics.registry
    labels = {"model": "tiny"}
    tokens_before = registry.get_sample_value("steadyserve_output_tokens_total", labels) or 0
    firsts_before = (
        registry.get_sample_value("steadyserve_time_to_first_token_seconds_count", labels) or 0
    )
    results = await asyncio.gather(
        *(
            generate(engine, prompt, SamplingParams(max_new_tokens=n))
            for prompt, n in zip(prompts, lengths, strict=True)
        )
    )
    for prompt, n, result in zip(prompts, lengths, results, strict=True):
        expected = expected_greedy(model, prompt, n)
        assert result.token_ids == expected.token_ids, (prompt, n)
        assert result.finish_reason is expected.finish_reason
        assert result.prompt_tokens == len(prompt)
    assert any(result.outputs > 2 for result in results), "tokens are streamed, one per step"
    report = await engine.debug("pool")
    assert report["tiny"]["slots_held"] == 0  # type: ignore[index]
    produced = sum(len(result.token_ids) for result in results)
    assert registry.get_sample_value("steadyserve_output_tokens_total", labels) == (
        tokens_before + produced
    )
    assert registry.get_sample_value(
        "steadyserve_time_to_first_token_seconds_count", labels
    ) == firsts_before + len(results)
    engine.refresh_metrics()
    assert registry.get_sample_value("steadyserve_kv_cache_usage_ratio", labels) == 0
    # The cache preallocated at start-up served every sequence: nothing was reallocated.
    assert storage == [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]


async def test_a_sequence_that_does_not_stream_gets_one_output_with_every_token(
    engine: InProcessEngine, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    tokenizer, model = reference
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS[:8]]
    results = await asyncio.gather(
        *(
            generate(engine, prompt, SamplingParams(max_new_tokens=24), stream=False)
            for prompt in prompts
        )
    )
    for prompt, result in zip(prompts, results, strict=True):
        expected = expected_greedy(model, prompt, 24)
        assert result.outputs == 1
        assert result.token_ids == expected.token_ids, prompt
        assert result.finish_reason is expected.finish_reason
    assert {result.finish_reason for result in results} >= {FinishReason.LENGTH}


async def test_warm_up_ran_prefill_and_decode_shapes_before_ready(engine: InProcessEngine) -> None:
    status = engine.status()
    assert status is not None and status.state == "ready"
    # Prefill at the length buckets below a chunk (16, 64) and a whole chunk (128); the
    # largest prompt's (255) later chunk (127 tokens from 128: over the first chunk's
    # keys, a shape the first chunk does not warm); on a CPU, a prefill at each token bucket
    # over the 8 slots those do not reach, up to a step of 256 (12, 24, 32, 48, 96, 192,
    # 256: `token_buckets.py`), and decode at every size up to all 8 slots (CUDA: 1, 2, 4, 8).
    cpu = not torch.cuda.is_available()  # the engine runs on "auto"
    assert status.warmup_total == 3 + 1 + (7 + 8 if cpu else 4)
    assert status.warmup_done == status.warmup_total


async def test_max_new_tokens_ends_with_length(engine: InProcessEngine) -> None:
    result = await generate(engine, [1, 40, 41, 42], SamplingParams(max_new_tokens=5))
    assert result.finish_reason is FinishReason.LENGTH
    assert len(result.token_ids) == 5
    single = await generate(engine, [1, 40, 41, 42], SamplingParams(max_new_tokens=1))
    assert single.token_ids == result.token_ids[:1] and single.outputs == 1


async def test_oversized_request_is_refused_and_others_still_served(
    engine: InProcessEngine,
) -> None:
    prompt = list(range(10, 30))
    with pytest.raises(EngineRefused, match="generate_slot_tokens") as refused:
        await generate(engine, prompt, SamplingParams(max_new_tokens=SLOT_TOKENS))
    assert str(SLOT_TOKENS) in str(refused.value)
    fits = await generate(engine, prompt, SamplingParams(max_new_tokens=SLOT_TOKENS - len(prompt)))
    assert fits.finish_reason in (FinishReason.LENGTH, FinishReason.EOS)


async def test_seeded_sampling_repeats_and_top_k_one_is_greedy(engine: InProcessEngine) -> None:
    prompt = [1, 50, 60, 70, 80]
    sampled = SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.5, seed=7)
    first = await generate(engine, prompt, sampled)
    again = await generate(engine, prompt, sampled)
    assert first.token_ids == again.token_ids
    other_seed = SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.5, seed=8)
    assert (await generate(engine, prompt, other_seed)).token_ids != first.token_ids
    greedy = await generate(engine, prompt, SamplingParams(max_new_tokens=12))
    top_one = SamplingParams(max_new_tokens=12, do_sample=True, top_k=1, seed=3)
    assert (await generate(engine, prompt, top_one)).token_ids == greedy.token_ids


async def test_embedding_and_generation_models_side_by_side(tiny_causal_lm: Path) -> None:
    settings = settings_for(tiny_causal_lm, max_batch_size=4)  # warm-up measures costs
    settings = settings.model_copy(
        update={"models": (ModelSpec(name="minilm", task="embed"), *settings.models)}
    )
    engine = await started(settings)
    try:
        embed = Submit(
            engine.next_request_id(),
            "minilm",
            time.monotonic() + 60,
            EmbedPayload([[101, 7592, 102]]),
        )
        embedded, generated = await asyncio.gather(
            anext(engine.stream(embed)),
            generate(engine, [1, 40, 41, 42], SamplingParams(max_new_tokens=4)),
        )
        assert isinstance(embedded.payload, EmbedOutput) and embedded.payload.rows == 1
        assert len(generated.token_ids) == 4
        status = engine.status()
        assert status is not None
        # The embedding model's cost per input, not the generation host's 0, and the
        # compute its admission adds for a one-input batch of its smallest shape.
        assert status.seconds_per_input > 0
        shapes = (await engine.debug("pool"))["minilm"]["shapes"]  # type: ignore[index]
        one_input = next(s for s in shapes if (s["batch"], s["length"]) == (1, 16))
        assert status.least_own_compute_s * 1000 == pytest.approx(
            one_input["estimated_compute_ms"], abs=0.001
        )
        assert status.least_own_compute_s > 0
        assert {name: info.task for name, info in status.models.items()} == {
            "minilm": "embed",
            "tiny": "generate",
        }
        wrong = Submit(
            engine.next_request_id(), "tiny", time.monotonic() + 60, EmbedPayload([[1, 2]])
        )
        with pytest.raises(EngineRefused, match="generates text"):
            await anext(engine.stream(wrong))
    finally:
        await engine.close()
