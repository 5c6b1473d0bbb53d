"""`steadyserve_time_per_output_token_seconds`, on a clock that moves one second per forward
(the tiny random-weight causal LM, its default steps per dispatch): a sequence's mean time between
its tokens runs from its first kept token to its last, whether it ends at EOS (chosen one
step after its last kept token, and not kept) or by its deadline (noticed between steps,
after its last token); and a run ends at the deadline of a sequence that does not stream."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedModel

from app.engine.generation_host import GenerationHost
from app.engine.generation_sequences import GenerationSequence
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import FinishReason, GeneratePayload, SamplingParams, Submit
from app.models.causal_lm import StepRow
from tests.support.generation_engine import (
    SLOT_TOKENS,
    collect,
    expected_greedy,
    started_on_clock,
    tiny_model_that_also_ends_at,
)
from tests.support.manual_clock import ManualClock

pytestmark = pytest.mark.asyncio(loop_scope="module")

START = 1000.0


async def engine_on_forward_clock(
    source: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[InProcessEngine, GenerationHost, ManualClock]:
    """An engine (no warm-up) whose clock moves one second with each forward of the model,
    and nowhere else; its step-time estimate held at that second."""
    clock = ManualClock(START)
    engine, host = await started_on_clock(source, clock)
    model_step = host.runner.step

    def one_second_a_forward(rows: Sequence[StepRow]) -> list[int]:
        tokens = model_step(rows)
        clock.now += 1.0
        return tokens

    monkeypatch.setattr(host.runner, "step", one_second_a_forward)
    host._step_s = 1.0
    monkeypatch.setattr(host, "_record_step", lambda result: None)
    return engine, host, clock


def per_token(engine: InProcessEngine) -> tuple[float | None, float | None]:
    """The histogram's count and sum for the tiny model."""
    registry = engine.core.metrics.registry
    name = "steadyserve_time_per_output_token_seconds"
    labels = {"model": "tiny"}
    return (
        registry.get_sample_value(f"{name}_count", labels),
        registry.get_sample_value(f"{name}_sum", labels),
    )


@pytest.mark.parametrize("stream", [True, False])
async def test_a_sequence_ending_at_eos_is_timed_to_its_last_kept_token(
    tmp_path: Path,
    reference: tuple[AutoTokenizer, PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    """Two tokens kept (forwards 1 and 2), EOS chosen by forward 3: one interval of one
    second. Timed to the step that chose EOS, it read two seconds: every sequence ending at
    EOS had its mean inflated by one step over its tokens (double for a 2-token answer); one
    that does not stream gets its run's tokens with the ending one, in one hand-over."""
    _, model = reference
    prompt = [1, 50, 60, 70]
    plain = expected_greedy(model, prompt, 10).token_ids
    stop = plain[2]
    assert stop not in plain[:2], "the premise: the third token is the first to stop it"
    directory = tiny_model_that_also_ends_at(tmp_path / "eos", stop)
    engine, _, clock = await engine_on_forward_clock(directory, monkeypatch)
    try:
        request = Submit(
            engine.next_request_id(),
            "tiny",
            START + 120,
            GeneratePayload(prompt, SamplingParams(max_new_tokens=10), stream=stream),
        )
        result = await collect(engine.stream(request))
    finally:
        await engine.close()
    assert (result.token_ids, result.finish_reason) == (plain[:2], FinishReason.EOS)
    assert clock.now == START + 3  # the forward that chose EOS ran
    assert per_token(engine) == (1.0, pytest.approx(1.0))


async def test_a_sequence_its_deadline_ends_is_timed_to_its_last_token(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence fitted to its deadline whose third token came out, then a loop turn that
    comes 30 s later (the loop waited for a shared compute slot): it ends with `length`
    there, 3 tokens in 2 s. Timed to that check, it read 16 s a token."""
    engine, host, clock = await engine_on_forward_clock(tiny_causal_lm, monkeypatch)
    expire = host._expire

    def late_turn(now: float, sparing: set[GenerationSequence] | None = None) -> None:
        if any(len(s.generated) == 3 for s in host._batch.everyone()) and clock.now < START + 30:
            clock.now += 30.0
        expire(clock.now, sparing)

    monkeypatch.setattr(host, "_expire", late_turn)
    sampling = SamplingParams(max_new_tokens=SLOT_TOKENS - 4, fit_to_deadline=True)
    # 33.5 s: a cap of 30 tokens; the late turn at 1033 leaves less than a step.
    request = Submit(
        engine.next_request_id(), "tiny", START + 33.5, GeneratePayload([1, 40], sampling)
    )
    try:
        result = await collect(engine.stream(request))
    finally:
        await engine.close()
    assert (len(result.token_ids), result.finish_reason) == (3, FinishReason.LENGTH)
    assert per_token(engine) == (1.0, pytest.approx(1.0))


async def test_a_run_stops_at_the_deadline_of_a_sequence_that_does_not_stream(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence that does not stream, 12 tokens asked, its deadline 10.5 s away: admitted
    on steps estimated at 0.5 s, which turn out to take 1 s (the estimate is 1 s once its
    prefill ran). Its tokens are taken, and its deadline checked, only as a run ends: the
    run stops at its deadline (9 steps), and it fails (504) one step later, after 11
    forwards. A run to its length passed the deadline by 2.5 s before it was noticed."""
    engine, host, clock = await engine_on_forward_clock(tiny_causal_lm, monkeypatch)
    host._step_s = 0.5
    timed_step = host.runner.step

    def slower_than_admitted(rows: Sequence[StepRow]) -> list[int]:
        tokens = timed_step(rows)
        host._step_s = 1.0
        return tokens

    monkeypatch.setattr(host.runner, "step", slower_than_admitted)
    payload = GeneratePayload([1, 40], SamplingParams(max_new_tokens=12), stream=False)
    request = Submit(engine.next_request_id(), "tiny", START + 10.5, payload)
    try:
        with pytest.raises(Exception) as failed:
            await collect(engine.stream(request))
    finally:
        await engine.close()
    assert "deadline" in str(failed.value)
    assert clock.now == START + 11
