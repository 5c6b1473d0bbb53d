"""Chunked prefill (`generate_prefill_chunk_tokens`), with the tiny random-weight causal LM
through the engine protocol: with chunks of 8 tokens and prompts of 1 to 60 tokens, 17
concurrent sequences' greedy tokens equal `model.generate` one prompt at a time, seeded
samples and prompt and token log probabilities are those of whole-prompt prefill (chunks of
the whole slot), no step feeds a sequence more than a chunk while decode rows keep stepping
beside a long prompt's chunks, and a cancel mid-prefill frees the slot at once. Before it,
a prompt was one row of all its tokens: the chunk checks fail on that code."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedModel

from app.engine.generation_host import GenerationHost
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import GeneratePayload, SamplingParams, Submit, TokensOutput
from app.models.causal_lm import StepRow
from loadtest.tiny_causal_lm import CORPUS
from tests.support.generation_engine import (
    SLOT_TOKENS,
    expected_greedy,
    generate,
    settings_for,
    started,
    submit,
)
from tests.support.held_step import held_step

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHUNK = 8
LENGTHS = [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 23, 31, 32, 33, 41, 52, 60]


def prompts(tokenizer: AutoTokenizer) -> list[list[int]]:
    ids: list[int] = tokenizer(" ".join(CORPUS))["input_ids"]
    assert len(ids) > 200
    return [ids[index * 7 : index * 7 + length] for index, length in enumerate(LENGTHS)]


async def chunked_engine(source: Path, chunk: int, **overrides: object) -> InProcessEngine:
    settings = settings_for(source, warmup=False, generate_prefill_chunk_tokens=chunk, **overrides)
    return await started(settings)


def record_dispatches(engine: InProcessEngine) -> list[list[tuple[int, int, int]]]:
    """Each dispatch's rows as (slot, tokens fed, start), in the order they ran."""
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    steps = host._steps
    dispatches: list[list[tuple[int, int, int]]] = []
    real = steps._forwards

    def recording(rows: Sequence[StepRow], *rest: object):  # type: ignore[no-untyped-def]
        dispatches.append([(row.slot, len(row.token_ids), row.start) for row in rows])
        return real(rows, *rest)  # type: ignore[arg-type]

    steps._forwards = recording  # type: ignore[method-assign]
    return dispatches


def assert_chunked(dispatches: list[list[tuple[int, int, int]]]) -> None:
    rows = [row for dispatch in dispatches for row in dispatch]
    assert max(fed for _, fed, _ in rows) <= CHUNK, "a row fed more than a chunk"
    assert any(start > 0 and fed > 1 for _, fed, start in rows), "no prompt took two chunks"


async def test_greedy_equals_generate_with_small_chunks(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    tokenizer, model = reference
    engine = await chunked_engine(tiny_causal_lm, CHUNK)
    try:
        dispatches = record_dispatches(engine)
        cases = prompts(tokenizer)
        lengths = [4 + (index * 5) % 13 for index in range(len(cases))]
        results = await asyncio.gather(
            *(
                generate(engine, prompt, SamplingParams(max_new_tokens=n))
                for prompt, n in zip(cases, lengths, strict=True)
            )
        )
        for prompt, n, result in zip(cases, lengths, results, strict=True):
            expected = expected_greedy(model, prompt, n)
            assert result.token_ids == expected.token_ids, (len(prompt), n)
            assert result.finish_reason is expected.finish_reason
            assert 0 not in result.sizes, "a chunk sent an empty output"
        assert_chunked(dispatches)
        assert (await engine.debug("pool"))["tiny"]["slots_held"] == 0  # type: ignore[index]
    finally:
        await engine.close()


async def outputs_of(engine: InProcessEngine, prompt: list[int], sampling: SamplingParams) -> list:  # type: ignore[type-arg]
    request = Submit(
        engine.next_request_id(), "tiny", time.monotonic() + 120, GeneratePayload(prompt, sampling)
    )
    payloads = []
    async for output in engine.stream(request):
        assert isinstance(output.payload, TokensOutput)
        payloads.append(output.payload)
    return payloads


async def run_both(
    source: Path, cases: list[list[int]], sampling: list[SamplingParams]
) -> tuple[list[list[TokensOutput]], list[list[TokensOutput]]]:
    answers = []
    for chunk in (CHUNK, SLOT_TOKENS):
        engine = await chunked_engine(source, chunk)
        try:
            dispatches = record_dispatches(engine)
            answers.append(
                await asyncio.gather(
                    *(outputs_of(engine, p, s) for p, s in zip(cases, sampling, strict=True))
                )
            )
            if chunk == CHUNK:
                assert_chunked(dispatches)
        finally:
            await engine.close()
    return answers[0], answers[1]


async def test_seeded_samples_are_identical_with_and_without_chunks(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    cases = prompts(reference[0])
    sampling = [
        SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.3, seed=100 + index)
        for index in range(len(cases))
    ]
    chunked, whole = await run_both(tiny_causal_lm, cases, sampling)
    tokens = [[t for p in answer for t in p.token_ids] for answer in chunked]
    assert tokens == [[t for p in answer for t in p.token_ids] for answer in whole]
    assert len({tuple(t) for t in tokens}) > len(tokens) // 2  # they did sample


async def test_prompt_and_token_logprobs_are_those_of_whole_prefill(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    cases = prompts(reference[0])
    sampling = [SamplingParams(max_new_tokens=3, logprobs=2, prompt_logprobs=2) for _ in cases]
    chunked, whole = await run_both(tiny_causal_lm, cases, sampling)
    for prompt, mine, theirs in zip(cases, chunked, whole, strict=True):
        assert [p.token_ids for p in mine] == [p.token_ids for p in theirs]
        firsts = [p.prompt_logprobs for p in mine if p.prompt_logprobs is not None]
        wholes = [p.prompt_logprobs for p in theirs if p.prompt_logprobs is not None]
        assert len(firsts) == len(wholes) == 1 and len(firsts[0]) == len(prompt) - 1
        pairs = [*zip(firsts[0], wholes[0], strict=True)]
        pairs += [
            pair
            for a, b in zip(mine, theirs, strict=True)
            for pair in zip(a.logprobs or [], b.logprobs or [], strict=True)
        ]
        for a, b in pairs:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top_ids == b.top_ids
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)


async def test_decode_rows_keep_stepping_while_a_long_prompt_prefills(
    tiny_causal_lm: Path,
) -> None:
    """Each step feeds a 60-token prompt one chunk (starts 0, 8, ..., 56), beside the decode
    rows of the sequences already running; before, one step fed all 60 tokens while every
    running sequence waited for it."""
    engine = await chunked_engine(tiny_causal_lm, CHUNK)
    try:
        dispatches = record_dispatches(engine)
        runners = [
            engine.stream(submit(engine, [1, 30 + i, 31 + i], SamplingParams(max_new_tokens=60)))
            for i in range(4)
        ]
        for stream in runners:
            await anext(stream)  # each has its first token: decoding
        long_prompt = [(7 * i) % 200 + 3 for i in range(60)]
        late = await generate(engine, long_prompt, SamplingParams(max_new_tokens=2))
        assert late.prompt_tokens == 60
        slot = next(s for d in dispatches for s, fed, start in d if start == 0 and fed > 3)
        chunks = [
            (index, start, fed)
            for index, dispatch in enumerate(dispatches)
            for row_slot, fed, start in dispatch
            if row_slot == slot and start < 60
        ]
        assert [start for _, start, _ in chunks] == list(range(0, 60, CHUNK)), chunks
        assert max(fed for _, _, fed in chunks) <= CHUNK
        assert sum(fed for _, _, fed in chunks) == 60
        for index, _, _ in chunks:  # each chunk's dispatch also ran the decode rows
            decoding = [row for row in dispatches[index] if row[0] != slot]
            assert decoding and all(fed == 1 for _, fed, _ in decoding), dispatches[index]
        assert len([r for r in dispatches[chunks[0][0]] if r[0] != slot]) == 4
        for stream in runners:
            await stream.aclose()
    finally:
        await engine.close()


async def test_a_cancel_mid_prefill_frees_the_slot_at_once(tiny_causal_lm: Path) -> None:
    """One slot: a 60-token prompt is cancelled while its second chunk computes; the slot is
    free at once (not when its prefill would end), and the next request is served."""
    engine = await chunked_engine(tiny_causal_lm, CHUNK, generate_slots=1)
    core, host = engine.core, engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    try:
        with held_step(host.runner, at=2) as second_chunk:
            request = submit(engine, list(range(3, 63)), SamplingParams(max_new_tokens=5))
            answers: list[object] = []
            core.submit(b"front", request, answers.append)
            assert await asyncio.to_thread(second_chunk.reached.wait, 60)
            sequence = next(iter(host._batch.running.values()))
            assert sequence.prefilled == CHUNK and sequence.prefilling
            core.cancel(b"front", request.request_id)
            for _ in range(1000):
                report = (await engine.debug("pool"))["tiny"]
                if report["slots_held"] == 0:  # type: ignore[index]
                    break
                await asyncio.sleep(0)
            assert report["slots_held"] == 0, report  # type: ignore[index]
            assert not second_chunk.released.is_set()  # freed while its chunk computed
        after = await generate(engine, [1, 40, 41], SamplingParams(max_new_tokens=3))
        assert after.prompt_tokens == 3 and after.token_ids
        assert answers == []  # a cancelled sequence is answered nothing
    finally:
        await engine.close()


async def test_a_failed_step_reruns_a_later_chunk_on_its_earlier_ones(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """A step that raises while a prompt's third chunk runs beside decode rows is triaged:
    the chunk runs again alone, over the earlier chunks still in its slot (not zeroed), and
    every answer is still `model.generate`'s."""
    tokenizer, model = reference
    engine = await chunked_engine(tiny_causal_lm, CHUNK)
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    real_step = host.runner.step
    failed: list[tuple[int, int]] = []

    def failing_once(rows: Sequence[StepRow]) -> list[int]:
        chunk = [row for row in rows if row.prefill and row.start == 2 * CHUNK]
        if chunk and not failed:
            failed.append((chunk[0].start, len(rows)))
            raise RuntimeError("injected")
        return real_step(rows)

    host.runner.step = failing_once  # type: ignore[method-assign]
    try:
        cases = prompts(tokenizer)
        results = await asyncio.gather(
            *(generate(engine, p, SamplingParams(max_new_tokens=6)) for p in cases)
        )
        assert failed, "no step ran a third chunk"
        for prompt, result in zip(cases, results, strict=True):
            assert result.token_ids == expected_greedy(model, prompt, 6).token_ids, len(prompt)
    finally:
        await engine.close()
