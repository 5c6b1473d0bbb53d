"""A generated sequence's deadline in the engine, with the tiny random-weight causal LM
on a clock the test sets: passing it mid-sequence fails the sequence and frees its slot,
after the tokens already computed; a sequence without a client-set limit is fitted to it
and ends with `length`; the step time the fit divides by is measured warm."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from app.admission import Rejected, RejectReason
from app.engine import generation_steps
from app.engine.generation_host import GenerationHost
from app.engine.protocol import (
    FinishReason,
    GeneratePayload,
    Output,
    SamplingParams,
    Submit,
    TokensOutput,
)
from app.failures import DeadlineExceeded
from app.models.causal_lm import CausalLMRunner, StepRow
from tests.support.generation_engine import (
    SLOT_TOKENS,
    SLOTS,
    collect,
    settings_for,
    started,
    started_on_clock,
    submit,
)
from tests.support.manual_clock import ManualClock

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_a_deadline_passing_mid_sequence_fails_it_and_frees_its_slot(
    tiny_causal_lm: Path,
) -> None:
    clock = ManualClock(1000.0)
    engine, host = await started_on_clock(tiny_causal_lm, clock)
    try:
        request = Submit(
            engine.next_request_id(),
            "tiny",
            clock.now + 10,
            GeneratePayload([1, 40, 41], SamplingParams(max_new_tokens=200)),
        )
        received = 0
        with pytest.raises(DeadlineExceeded, match="after"):
            async for _ in engine.stream(request):
                received += 1
                clock.now += 20  # past the deadline before the next step
        assert 1 <= received < 200
        assert host.debug_report()["slots_held"] == 0
    finally:
        await engine.close()


async def test_a_sequence_without_a_client_set_limit_is_fitted_to_its_deadline(
    tiny_causal_lm: Path,
) -> None:
    """A request asking for its prompt's whole room used to be refused 504 whenever room x
    step time passed its deadline (every chat request without max_tokens on a slow model),
    although it might stop at EOS soon. Without a client-set limit it is admitted on one
    token's time and ends with `length` once the deadline's share of steps is spent."""
    clock = ManualClock(1000.0)
    engine, host = await started_on_clock(tiny_causal_lm, clock)
    host._step_s = 1.0  # as if each step took a second
    room = SLOT_TOKENS - 3
    try:

        def request(fit: bool) -> Submit:
            sampling = SamplingParams(max_new_tokens=room, fit_to_deadline=fit)
            return Submit(
                engine.next_request_id(),
                "tiny",
                clock.now + 5.5,
                GeneratePayload([1, 40, 41], sampling),
            )

        with pytest.raises(Rejected) as refused:
            await collect(engine.stream(request(fit=False)))
        assert refused.value.reason is RejectReason.DEADLINE
        fitted = await collect(engine.stream(request(fit=True)))
        # 5.5 s x DEADLINE_FIT_SHARE at 1 s a step: 4 tokens (this prompt meets no EOS).
        assert (len(fitted.token_ids), fitted.finish_reason) == (4, FinishReason.LENGTH)
    finally:
        await engine.close()


async def test_a_fitted_sequence_short_of_time_ends_with_length_not_a_504(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its cap is planned from the compute time of a step; a token really takes longer (the
    loop's turn between steps), so it reached its deadline before its cap and was failed
    504, its whole answer lost. It now ends with `length` once another step would not fit."""
    clock = ManualClock(1000.0)
    engine, host = await started_on_clock(tiny_causal_lm, clock)
    host._step_s = 1.0
    # Held at 1 s: measured steps (milliseconds) would otherwise smooth it away, and whether
    # the half second left below still fits a step would depend on how many ran.
    monkeypatch.setattr(host, "_record_step", lambda result: None)
    deadline = clock.now + 40.0  # a cap of 36 tokens at 1 s a step
    sampling = SamplingParams(max_new_tokens=SLOT_TOKENS - 4, fit_to_deadline=True)
    request = Submit(engine.next_request_id(), "tiny", deadline, GeneratePayload([1, 40], sampling))
    try:
        outputs = []
        async for output in engine.stream(request):
            outputs.append(output)
            if len(outputs) == 2:
                clock.now = deadline - 0.5  # steps took longer than planned
        final = outputs[-1].payload
        assert isinstance(final, TokensOutput) and final.finish_reason is FinishReason.LENGTH
        assert 2 <= sum(len(o.payload.token_ids) for o in outputs) < 36
        assert host.debug_report()["slots_held"] == 0
    finally:
        await engine.close()


async def test_the_step_time_estimate_comes_from_a_warm_step_of_every_slot(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first step of a shape pays its set-up: seeding the estimate (which admission and
    the deadline fit divide by) from that cold step overstated it until traffic smoothed it.
    The steps' times are the test's: the clock they are measured on (`generation_steps`'
    perf_counter) moves only as each step runs, by a time that names it (the nth step takes
    n ms; the first all-slot one, cold, 300 ms)."""
    steps: list[int] = []
    durations: list[float] = []
    clock = ManualClock(1000.0)
    original = CausalLMRunner.step

    def timed(self: CausalLMRunner, rows: list[StepRow]) -> list[int]:
        steps.append(len(rows))
        cold = len(rows) == SLOTS and steps.count(SLOTS) == 1  # a new shape's first step
        durations.append(0.3 if cold else len(steps) / 1000)
        clock.now += durations[-1]
        return original(self, rows)

    monkeypatch.setattr(CausalLMRunner, "step", timed)
    monkeypatch.setattr(generation_steps, "time", SimpleNamespace(perf_counter=clock))
    engine = await started(settings_for(tiny_causal_lm))
    try:
        # Decode at every size up to all 8 slots (CUDA: 1, 2, 4, 8), then all 8 again: the
        # estimate's step.
        sizes = list(range(1, SLOTS + 1)) if not torch.cuda.is_available() else [1, 2, 4, SLOTS]
        assert steps[-len(sizes) - 1 :] == [*sizes, SLOTS]
        host = engine.core.hosts["tiny"]
        assert isinstance(host, GenerationHost)
        # Seeded from the warm all-slot step (the last), not the cold one (300 ms).
        assert host.debug_report()["step_ms"] == round(durations[-1] * 1000, 3), durations
    finally:
        await engine.close()


async def test_an_expiring_stream_gets_its_last_tokens_before_its_failure(
    tiny_causal_lm: Path,
) -> None:
    engine = await started(settings_for(tiny_causal_lm))
    try:
        host = engine.core.hosts["tiny"]
        assert isinstance(host, GenerationHost)
        received: list[object] = []
        request = submit(engine, [1, 50, 51], SamplingParams(max_new_tokens=3))
        engine.core.submit(b"front", request, received.append)
        [sequence] = [s for s in host._batch.waiting if s.request.request_id == request.request_id]
        pending = Output(request.request_id, False, TokensOutput([7], 3), 0.0, 0.0)
        host._outbox = [(sequence, pending)]  # the last step's, not sent yet
        host._expire(request.deadline + 1)
        assert [type(message).__name__ for message in received] == ["Output", "Failure"]
    finally:
        await engine.close()
