"""A multi-step run hands each step's tokens to the event loop as the step ends, while the
compute thread runs the next: a client that streams sees each token as it is made, not a
run's worth at its end (a first token whose text is an incomplete character waited a whole
run to show: the late first tokens of multi-step decoding over HTTP); a run yields the
compute slots after one step when another model gets in line for them, or was in line when
it started; a sequence that does not stream is answered as its row leaves the run, not when
the run ends; a new sequence's wait counts the steps a run computed for rows whose tokens
it holds; and a failure while taking a run's step fails the loop's sequences instead of
leaving them unanswered."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedModel

from app.engine.generation_host import GenerationHost
from app.engine.generation_sequences import GenerationSequence
from app.engine.protocol import FinishReason, SamplingParams, TokensOutput
from app.models.causal_lm import StepRow
from tests.support.generation import generate_settings
from tests.support.generation_engine import (
    SLOT_TOKENS,
    SLOTS,
    Generated,
    collect,
    expected_greedy,
    generate,
    record_runs,
    settings_for,
    started,
    submit,
    tiny_model_that_also_ends_at,
)
from tests.support.held_step import held_step

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [1, 50, 60, 70, 80]
# The first stops at EOS (a token greedy decoding gives it 6th); the second never does.
EOS_PROMPT, BESIDE_PROMPT = [1, 50, 60, 70], [1, 40, 41, 42]
STEP_WAIT_S = 60.0  # a bound on a wait for the other thread, never reached when it works
HEAD_WAIT_S = 10.0  # likewise, for a streamed token (a failure here takes this long)


async def test_a_run_streams_each_token_as_its_step_ends(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """A 60-step run whose 4th step is held in the model: the client has the prefill's
    token and the run's first three before the held step ends."""
    _, model = reference
    engine = await started(
        settings_for(tiny_causal_lm, warmup=False, generate_steps_per_dispatch=60)
    )
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    runs = record_runs(engine)
    try:
        # Its 5th forward: the prefill, then the run's steps 1-3 ran.
        with held_step(host.runner, at=5) as held:
            stream = engine.stream(submit(engine, PROMPT, SamplingParams(max_new_tokens=20)))
            # Without hand-overs a run's tokens come at its end, after the held step: never.
            head = [await asyncio.wait_for(anext(stream), HEAD_WAIT_S) for _ in range(4)]
            assert await asyncio.to_thread(held.reached.wait, STEP_WAIT_S), "the run went on"
        rest = await collect(stream)
    finally:
        await engine.close()
    head_tokens = [t for o in head for t in o.payload.token_ids]  # type: ignore[union-attr]
    assert head_tokens + rest.token_ids == expected_greedy(model, PROMPT, 20).token_ids
    assert all(isinstance(o.payload, TokensOutput) and not o.final for o in head)
    assert runs[:2] == [1, 19], runs  # the prefill, then one run to the sequence's length


async def test_another_models_claim_ends_a_run_after_its_current_step(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """Two generate models share one compute slot: a request to the second, arriving while
    the first runs a 60-step run, gets in line, and the run ends after its current step
    (it held the slot for the whole run: a model beside a long generation waited it out);
    while the second has sequences, each of the first's dispatches is a step or so, also
    one started with the second already in line (no claim then tells it to end); both get
    model.generate's tokens."""
    _, model = reference
    settings = generate_settings(
        {"tiny": tiny_causal_lm, "other": tiny_causal_lm},
        slots=SLOTS,
        slot_tokens=SLOT_TOKENS,
        engine="inprocess",
        warmup=False,
        dispatcher_threads=1,
        generate_steps_per_dispatch=60,
    )
    engine = await started(settings)
    runs = record_runs(engine)
    other_host = engine.core.hosts["other"]
    assert isinstance(other_host, GenerationHost)
    beside_the_other = record_runs(engine, only_while=lambda: bool(other_host._batch))
    other_prompt = [1, 44, 45]
    try:
        stream = engine.stream(submit(engine, PROMPT, SamplingParams(max_new_tokens=150)))
        head = [await anext(stream) for _ in range(3)]  # the prefill, then the run streams
        assert runs == [1], "the first run computes now"
        other = submit(engine, other_prompt, SamplingParams(max_new_tokens=10))
        other = type(other)(other.request_id, "other", other.deadline, other.payload)
        joined = asyncio.create_task(collect(engine.stream(other)))
        rest = await collect(stream)
        beside = await joined
    finally:
        await engine.close()
    head_tokens = [t for o in head for t in o.payload.token_ids]  # type: ignore[union-attr]
    assert head_tokens + rest.token_ids == expected_greedy(model, PROMPT, 150).token_ids
    assert beside.token_ids == expected_greedy(model, other_prompt, 10).token_ids
    assert runs[1] < 60, f"the run went on with the other model in line: {runs}"
    # Those ended while the other had sequences, but the run its arrival cut short: one
    # step each (a few at most, should its loop's claim come a step late).
    assert len(beside_the_other) > 5 and max(beside_the_other[1:]) <= 3, beside_the_other


async def test_a_run_started_with_another_claimant_in_line_stops_after_a_step(
    tiny_causal_lm: Path,
) -> None:
    """Two compute slots, another claimant already in line for one (no claim comes during
    the run to end it): each dispatch is one step; out of line, the run goes on."""
    engine = await started(
        settings_for(
            tiny_causal_lm, warmup=False, dispatcher_threads=2, generate_steps_per_dispatch=60
        )
    )
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    runs = record_runs(engine)
    slots = host._context.slots
    try:
        slots.claim("a batch of another model")  # in line before the run starts
        lined = await generate(engine, PROMPT, SamplingParams(max_new_tokens=8))
        in_line = list(runs)
        slots.withdraw("a batch of another model")
        alone = await generate(engine, PROMPT, SamplingParams(max_new_tokens=8))
    finally:
        await engine.close()
    assert lined.token_ids == alone.token_ids
    assert in_line == [1] * 8, in_line
    assert runs[8:] == [1, 7], runs


async def test_a_sequence_that_does_not_stream_is_answered_as_its_row_leaves_the_run(
    tmp_path: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """A sequence that does not stream stops at EOS at its 6th token inside a 60-step run
    beside one that streams: its answer comes as its row leaves the run, before its
    neighbour's 9th token, not when the run ends with the neighbour's 12th (its tokens were
    held to the run's end, and a deadline check between steps saw it without them)."""
    _, model = reference
    stopped, beside = EOS_PROMPT, BESIDE_PROMPT
    plain = expected_greedy(model, stopped, 10).token_ids
    stop = plain[5]
    assert stop not in plain[:5]
    assert stop not in expected_greedy(model, beside, 12).token_ids, "only the first stops"
    directory = tiny_model_that_also_ends_at(tmp_path / "eos", stop)
    engine = await started(settings_for(directory, warmup=False, generate_steps_per_dispatch=60))
    events: list[str] = []

    async def streamed() -> None:
        request = submit(engine, beside, SamplingParams(max_new_tokens=12))
        async for output in engine.stream(request):
            assert isinstance(output.payload, TokensOutput)
            events.extend("token" for _ in output.payload.token_ids)

    async def whole() -> Generated:
        result = await generate(engine, stopped, SamplingParams(max_new_tokens=10), False)
        events.append("answer")
        return result

    try:
        answer, _ = await asyncio.gather(whole(), streamed())
    finally:
        await engine.close()
    assert answer.token_ids == plain[:5] and answer.finish_reason is FinishReason.EOS
    assert events.count("token") == 12
    assert events.index("answer") < 9, events


async def test_a_failure_taking_a_runs_step_fails_the_loops_sequences(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taking a step's tokens (`_advance`) raises inside a run (a bug of the server's): the
    loop's sequences fail with a 500 naming the generation loop, as when the loop itself
    fails, and the engine serves the next request."""
    engine = await started(
        settings_for(tiny_causal_lm, warmup=False, generate_steps_per_dispatch=60)
    )
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    real_advance, calls = host._advance, 0

    def advance_failing_in_the_run(
        sequences: list[GenerationSequence], tokens: list[list[int]]
    ) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:  # the prefill's, the run's first step's, then this one
            raise RuntimeError("a bug while taking a step")
        real_advance(sequences, tokens)

    monkeypatch.setattr(host._hand_over, "_advance", advance_failing_in_the_run)
    try:
        request = submit(engine, PROMPT, SamplingParams(max_new_tokens=40))
        with pytest.raises(Exception) as failed:
            await asyncio.wait_for(collect(engine.stream(request)), STEP_WAIT_S)
        after = await generate(engine, [1, 44, 45], SamplingParams(max_new_tokens=5))
    finally:
        await engine.close()
    assert "generation loop" in str(failed.value) and "RuntimeError" in str(failed.value)
    assert len(after.token_ids) == 5


async def test_a_new_sequence_s_wait_counts_the_steps_a_run_holds(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both slots held by sequences that do not stream, their run's 11th step held in the
    model: a sequence queued now waits for the steps the nearer one has left, less the 10
    the run computed (its tokens are taken only as the run ends). Counted from the tokens
    taken, the wait was overstated by the whole run so far."""
    engine = await started(
        settings_for(tiny_causal_lm, warmup=False, generate_slots=2, generate_steps_per_dispatch=60)
    )
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    real_step, decode_steps = host.runner.step, 0
    held, let_go = threading.Event(), threading.Event()

    def hold_the_runs_11th_step(rows: Sequence[StepRow]) -> list[int]:
        nonlocal decode_steps
        if not any(row.prefill for row in rows):
            decode_steps += 1
            if decode_steps == 11:
                held.set()
                let_go.wait(STEP_WAIT_S)
        return real_step(rows)

    monkeypatch.setattr(host.runner, "step", hold_the_runs_11th_step)
    sampling = SamplingParams(max_new_tokens=30)
    try:
        both = asyncio.gather(
            generate(engine, PROMPT, sampling, False),
            generate(engine, [1, 44, 45], sampling, False),
        )
        assert await asyncio.to_thread(held.wait, STEP_WAIT_S), "the run never got there"
        prefilled = [len(s.generated) for s in host._batch.running.values()]
        assert prefilled == [1, 1], "the premise: the run's tokens are not taken yet"
        # 29 tokens left each after the prefill's, 10 of them computed by the run.
        assert host._batch.steps_until_a_slot() == 29 - 10
        let_go.set()
        results = await both
    finally:
        let_go.set()
        await engine.close()
    assert [len(r.token_ids) for r in results] == [30, 30]
