"""The engine's generation step loop, with the tiny random-weight causal LM: EOS and
length endings, also inside a multi-step run (several decode steps per dispatch), which
gives the tokens of single steps, ends early when a row ends and a sequence waits, and
lets an arrival join without waiting for the run; a loop failing between steps, or
while handling one, still sends the outputs already made."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedModel

from app.engine.generation_host import GenerationHost
from app.engine.generation_sequences import GenerationSequence
from app.engine.host import Emit
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import FinishReason, GeneratePayload, SamplingParams, Submit
from app.models.causal_lm import StepRow
from tests.support.generation_engine import (
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

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.mark.parametrize("steps_per_dispatch", [1, 8])
async def test_eos_ends_the_sequence_without_the_token(
    tmp_path: Path, reference: tuple[AutoTokenizer, PreTrainedModel], steps_per_dispatch: int
) -> None:
    """A model whose EOS list holds a token greedy decoding reaches at step 6 (the
    generation config may name several): the engine stops there, as model.generate does,
    also when that step is inside a multi-step run (8 steps per dispatch), while the
    sequence decoding next to it goes on to its own end."""
    _, model = reference
    prompt, other = [1, 50, 60, 70], [1, 40, 41, 42]
    plain = expected_greedy(model, prompt, 10).token_ids
    stop = plain[5]
    assert stop not in plain[:5]
    beside = expected_greedy(model, other, 12).token_ids
    if stop in beside:
        beside = beside[: beside.index(stop)]
    assert len(beside) > 4, "the other sequence outlives the run that ends the first"
    directory = tiny_model_that_also_ends_at(tmp_path / "eos", stop)
    engine = await started(
        settings_for(directory, warmup=False, generate_steps_per_dispatch=steps_per_dispatch)
    )
    runs = record_runs(engine)
    try:
        result, next_to_it = await asyncio.gather(
            generate(engine, prompt, SamplingParams(max_new_tokens=10)),
            generate(engine, other, SamplingParams(max_new_tokens=12)),
        )
    finally:
        await engine.close()
    assert result.token_ids == plain[:5]
    assert result.finish_reason is FinishReason.EOS
    assert next_to_it.token_ids == beside
    if steps_per_dispatch > 1:  # EOS came inside a run: a prefill, then a run past it
        assert runs[:2] == [1, 8], runs


@pytest.mark.parametrize("steps_per_dispatch", [1, 8])
async def test_a_stop_token_ends_its_sequence_alone_as_eos_does(
    tiny_causal_lm: Path,
    reference: tuple[AutoTokenizer, PreTrainedModel],
    steps_per_dispatch: int,
) -> None:
    """A request's `stop_token_ids` (a stop string that is a special token's text) end it
    at that token, not kept, with `EOS`; another request's sequence goes on past it."""
    _, model = reference
    prompt = [1, 50, 60, 70]
    plain = expected_greedy(model, prompt, 10).token_ids
    stop = plain[5]
    assert stop not in plain[:5]
    engine = await started(
        settings_for(tiny_causal_lm, warmup=False, generate_steps_per_dispatch=steps_per_dispatch)
    )
    try:
        stopped, unstopped = await asyncio.gather(
            generate(engine, prompt, SamplingParams(max_new_tokens=10, stop_token_ids=(stop,))),
            generate(engine, prompt, SamplingParams(max_new_tokens=10)),
        )
    finally:
        await engine.close()
    assert (stopped.token_ids, stopped.finish_reason) == (plain[:5], FinishReason.EOS)
    assert (unstopped.token_ids, unstopped.finish_reason) == (plain, FinishReason.LENGTH)


# Two sequences in two slots, and a third for the slot the first frees when it chooses EOS.
EOS_PROMPT, BESIDE_PROMPT, THIRD_PROMPT = [1, 50, 60, 70], [1, 40, 41, 42], [1, 44, 45]


async def two_slot_engine_where_only_the_first_stops(
    directory: Path, model: PreTrainedModel
) -> tuple[InProcessEngine, list[int], list[int]]:
    """A started engine (2 slots, 8 steps a dispatch) whose model also ends at the token
    greedy decoding gives `EOS_PROMPT` 6th: that sequence stops after 5 tokens, and
    `BESIDE_PROMPT`'s 12 never hold it. The first's 5 tokens and the second's 12."""
    plain = expected_greedy(model, EOS_PROMPT, 10).token_ids
    stop = plain[5]
    beside = expected_greedy(model, BESIDE_PROMPT, 12).token_ids
    assert stop not in plain[:5] and stop not in beside, "the premise: only the first stops"
    directory = tiny_model_that_also_ends_at(directory, stop)
    engine = await started(
        settings_for(directory, warmup=False, generate_steps_per_dispatch=8, generate_slots=2)
    )
    return engine, plain[:5], beside


def assert_the_run_was_cut_at_the_first_eos(
    model: PreTrainedModel,
    results: tuple[Generated, Generated, Generated],
    stopped: list[int],
    beside: list[int],
    runs: list[int],
) -> None:
    """The first sequence stopped at EOS, the second went on beside it in a run cut at that
    step (the prefill, then the first's 5th decode step: not one of 8 steps), and the third
    took the freed slot with its own greedy tokens."""
    first, second, third = results
    assert first.finish_reason is FinishReason.EOS and first.token_ids == stopped
    assert second.token_ids == beside
    assert runs[:2] == [1, 5], runs
    assert third.token_ids == expected_greedy(model, THIRD_PROMPT, 4).token_ids


async def test_multi_step_decoding_gives_the_tokens_of_single_steps(tiny_causal_lm: Path) -> None:
    """24 sequences (greedy and seeded sampling, different prompts and lengths, half of
    them streamed) through 8 slots, so sequences join, finish and wait: 5 decode steps per
    dispatch give every sequence exactly the tokens one step per dispatch gives, and the
    same outputs: a streamed one an output a token, the others one output."""
    prompts = [[1, *range(40 + i, 40 + i + 3 + i % 9)] for i in range(24)]
    samplings = [
        SamplingParams(max_new_tokens=6 + (i * 5) % 23)
        if i % 3
        else SamplingParams(
            max_new_tokens=9 + i, do_sample=True, temperature=1.3, top_k=40, top_p=0.9, seed=i
        )
        for i in range(24)
    ]
    streams = [i % 2 == 0 for i in range(24)]
    results: dict[int, list[Generated]] = {}
    runs: dict[int, list[int]] = {}
    for steps in (1, 5):
        engine = await started(settings_for(tiny_causal_lm, generate_steps_per_dispatch=steps))
        runs[steps] = record_runs(engine)
        try:
            results[steps] = await asyncio.gather(
                *(
                    generate(engine, p, s, stream)
                    for p, s, stream in zip(prompts, samplings, streams, strict=True)
                )
            )
            assert (await engine.debug("pool"))["tiny"]["slots_held"] == 0  # type: ignore[index]
        finally:
            await engine.close()
    for single, multi in zip(results[1], results[5], strict=True):
        assert multi.token_ids == single.token_ids
        assert multi.finish_reason is single.finish_reason
        assert multi.sizes == single.sizes
    assert max(runs[1]) == 1 and max(runs[5]) == 5, "runs happened"
    streamed = [r for r, stream in zip(results[5], streams, strict=True) if stream]
    assert all(size <= 1 for r in streamed for size in r.sizes)
    assert all(r.outputs == 1 for r, stream in zip(results[5], streams, strict=True) if not stream)


async def test_an_arrival_interrupts_a_multi_step_run_and_joins(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """With 60 steps per dispatch, a request arriving while a run computes does not wait
    for it: the run stops after its current step, the newcomer is prefilled in the next
    dispatch, and both get model.generate's tokens."""
    _, model = reference
    first_prompt, second_prompt = [1, 50, 60, 70, 80], [1, 44, 45]
    first_expected = expected_greedy(model, first_prompt, 160)
    assert len(first_expected.token_ids) == 160, "no EOS: the runs are long"
    engine = await started(settings_for(tiny_causal_lm, generate_steps_per_dispatch=60))
    runs = record_runs(engine)
    try:
        stream = engine.stream(submit(engine, first_prompt, SamplingParams(max_new_tokens=160)))
        # The prefill (a single step), then a 60-step run streaming a token a step.
        head = [await anext(stream) for _ in range(3)]
        assert runs == [1], "the run computes now; this arrival must cut it short"
        second = asyncio.create_task(
            generate(engine, second_prompt, SamplingParams(max_new_tokens=10))
        )
        rest = await collect(stream)
        joined = await second
    finally:
        await engine.close()
    head_tokens = [t for o in head for t in o.payload.token_ids]  # type: ignore[union-attr]
    assert head_tokens + rest.token_ids == first_expected.token_ids
    assert runs[1] < 60, f"the run in flight went on to its end: {runs}"
    assert joined.token_ids == expected_greedy(model, second_prompt, 10).token_ids


async def test_a_multi_step_run_ends_when_a_row_ends_at_eos_and_a_sequence_waits(
    tmp_path: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """A row leaving the run at EOS frees its slot only when the run ends: the waiting
    sequence sat up to k-1 forwards longer while the batch ran a row short."""
    _, model = reference
    engine, stopped, beside = await two_slot_engine_where_only_the_first_stops(
        tmp_path / "eos", model
    )
    runs = record_runs(engine)
    try:
        first, second, third = await asyncio.gather(
            generate(engine, EOS_PROMPT, SamplingParams(max_new_tokens=10)),
            generate(engine, BESIDE_PROMPT, SamplingParams(max_new_tokens=12)),
            generate(engine, THIRD_PROMPT, SamplingParams(max_new_tokens=4)),
        )
    finally:
        await engine.close()
    assert_the_run_was_cut_at_the_first_eos(model, (first, second, third), stopped, beside, runs)


async def test_a_multi_step_run_ends_at_eos_for_a_sequence_that_arrived_during_it(
    tmp_path: Path,
    reference: tuple[AutoTokenizer, PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether a row's EOS ended the run was fixed when the run started (a sequence waited
    then), and an arrival with every slot held did not interrupt it: a sequence arriving
    during a run left the slot an EOS freed idle for the rest of the run (up to k-1
    forwards)."""
    _, model = reference
    engine, stopped, beside = await two_slot_engine_where_only_the_first_stops(
        tmp_path / "eos", model
    )
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    runs = record_runs(engine)
    loop = asyncio.get_running_loop()
    late: list[asyncio.Task[Generated]] = []
    submitted = threading.Event()
    host_submit, model_step = host.submit, host.runner.step
    forwards = itertools.count(1)

    def noted_submit(request: Submit, emit: Emit) -> asyncio.Task[None] | None:
        task = host_submit(request, emit)
        # The third's only: set by the first two's, the wait below returned at once, and
        # the third, held up for the GIL, could arrive after the first's EOS had passed.
        if list(getattr(request.payload, "prompt_ids", ())) == THIRD_PROMPT:
            submitted.set()
        return task

    def arrival_during_the_run(rows: Sequence[StepRow]) -> list[int]:
        # Forward 1 prefills both; 2 to 9 are the run. The third arrives in its 2nd step,
        # with both slots held.
        if next(forwards) == 3:
            start = lambda: late.append(  # noqa: E731
                loop.create_task(generate(engine, THIRD_PROMPT, SamplingParams(max_new_tokens=4)))
            )
            loop.call_soon_threadsafe(start)
            assert submitted.wait(30), "the arrival reached the host"
        return model_step(rows)

    monkeypatch.setattr(host, "submit", noted_submit)
    monkeypatch.setattr(host.runner, "step", arrival_during_the_run)
    try:
        first, second = await asyncio.gather(
            generate(engine, EOS_PROMPT, SamplingParams(max_new_tokens=10)),
            generate(engine, BESIDE_PROMPT, SamplingParams(max_new_tokens=12)),
        )
        third = await late[0]
    finally:
        await engine.close()
    assert_the_run_was_cut_at_the_first_eos(model, (first, second, third), stopped, beside, runs)


async def test_a_loop_failing_between_steps_still_sends_the_last_steps_outputs(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last step's outputs wait while the next step starts; a loop that fails there
    (a bug) must still send them: those sequences are finished and removed, so nothing
    else would ever answer them."""
    engine = await started(settings_for(tiny_causal_lm))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    original = host._next_step
    failures = iter([RuntimeError("a bug between steps")])

    def fail_once_all_are_done() -> list[GenerationSequence]:
        if not host._batch.running and not host._batch.waiting and (error := next(failures, None)):
            raise error
        return original()

    monkeypatch.setattr(host, "_next_step", fail_once_all_are_done)
    engine.answer_grace_s = 0.0  # a lost answer fails at the deadline, not hangs
    try:
        request = Submit(
            engine.next_request_id(),
            "tiny",
            time.monotonic() + 30,
            GeneratePayload([1, 40, 41], SamplingParams(max_new_tokens=3)),
        )
        finished = await collect(engine.stream(request))
        assert finished.finish_reason is not None  # its final output arrived
        assert next(failures, None) is None  # the loop did fail after the last step
        again = await generate(engine, [1, 50, 51], SamplingParams(max_new_tokens=2))
        assert again.finish_reason is not None  # and was restarted
    finally:
        await engine.close()


async def test_a_step_failing_after_a_sequence_finished_still_sends_its_final_output(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's outputs were kept in a local list until the whole step was handled, while a
    sequence that finished in it was already removed: a failure later in the same step (a
    bug) lost that final output, and the finished sequence, no longer the loop's, got no
    Failure either; its client waited for the deadline and got a 503."""
    engine = await started(settings_for(tiny_causal_lm, warmup=False))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    # A short deadline: a lost answer fails there (grace 0 below) instead of hanging.
    short = Submit(
        engine.next_request_id(),
        "tiny",
        time.monotonic() + 5,
        GeneratePayload([1, 40, 41], SamplingParams(max_new_tokens=2)),
    )
    long = submit(engine, [1, 50, 51], SamplingParams(max_new_tokens=8))
    finished: list[int] = []
    raised: list[int] = []
    take = GenerationSequence.take

    def take_then_fail(
        sequence: GenerationSequence, chosen: list[int], eos: frozenset[int]
    ) -> tuple[list[int], FinishReason | None]:
        request_id = sequence.request.request_id
        if request_id == long.request_id and finished and not raised:
            raised.append(request_id)
            raise RuntimeError("a bug after a sequence finished in this step")
        fresh, finish = take(sequence, chosen, eos)
        if finish is not None:
            finished.append(request_id)
        return fresh, finish

    monkeypatch.setattr(GenerationSequence, "take", take_then_fail)
    engine.answer_grace_s = 0.0
    try:
        done, failed = await asyncio.gather(
            collect(engine.stream(short)), collect(engine.stream(long)), return_exceptions=True
        )
        assert raised and finished == [short.request_id], "the premise: a finish, then a bug"
        assert isinstance(done, Generated), done  # not EngineUnavailable at its deadline
        assert done.finish_reason is FinishReason.LENGTH and len(done.token_ids) == 2
        assert isinstance(failed, Exception)  # the sequence the loop held fails (500)
    finally:
        await engine.close()


async def test_a_failed_step_is_charged_to_the_busy_time(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a step that returned was charged (`_record_step`): a failing step's compute,
    here 200 ms until it raised, was missing from the busy time. Every step from the second
    on fails: its triage's run of the decode row fails too, so the sequence fails."""
    engine = await started(settings_for(tiny_causal_lm, warmup=False))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    model_step = host.runner.step
    forwards = itertools.count(1)

    def second_forward_fails(rows: Sequence[StepRow]) -> list[int]:
        if next(forwards) >= 2:
            time.sleep(0.2)  # its compute, on the real clock it is timed by
            raise RuntimeError("this step fails")
        return model_step(rows)

    monkeypatch.setattr(host.runner, "step", second_forward_fails)
    try:
        with pytest.raises(Exception, match="failed computing a generation step"):
            await generate(engine, [1, 40, 41], SamplingParams(max_new_tokens=4))
    finally:
        await engine.close()
    busy = engine.core.metrics.registry.get_sample_value(
        "steadyserve_dispatcher_busy_seconds_total", {"model": "tiny"}
    )
    assert busy is not None and busy >= 0.2
