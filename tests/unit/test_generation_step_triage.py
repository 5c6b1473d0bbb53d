"""A failed generation step is blamed narrowly (`generation_triage.py`): the sequences
decoding beside a prompt the model throws on, or beside a prefill that ran out of memory,
go on; only a prompt that fails alone fails (400), and health hears only of what fails
after the triage. One such prompt answered 500 to every sequence of its step, and counted
against /healthz. The tiny model in-process, its `step` failing on chosen prompts."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from app.engine.client import EngineRefused
from app.engine.generation_host import GenerationHost
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import GeneratePayload, SamplingParams, Submit
from app.failures import BatchFailed, DeadlineExceeded, DeviceLost
from app.models.causal_lm import StepRow
from app.settings import Settings
from tests.support.generation_engine import (
    collect,
    generate,
    settings_for,
    started,
    started_on_clock,
    submit,
)
from tests.support.manual_clock import ManualClock

DECODING = [1, 40, 41]  # decodes 12 tokens without EOS (tests/integration/generation_engine)
HEALTHY = [1, 44, 45]
POISON = [1, 60, 61, 62, 63]  # the model throws on it
LONGEST = [1, *range(100, 112)]
TOKENS = SamplingParams(max_new_tokens=12)


def single_steps(tiny_causal_lm: Path) -> Settings:
    """One step a dispatch: the joiners, submitted once DECODING has its first token, join
    a step in which it decodes (a multi-step run could finish it first on a busy machine,
    its loop turns going to the hand-overs)."""
    return settings_for(tiny_causal_lm, warmup=False, generate_steps_per_dispatch=1)


Fails = Callable[[Sequence[StepRow]], BaseException | None]
Calls = list[list[tuple[tuple[int, ...], int]]]


def failing_steps(host: GenerationHost, monkeypatch: pytest.MonkeyPatch, fails: Fails) -> Calls:
    """The model's step raises `fails(rows)` where that is an exception; returns each
    step's rows, as (prompt or last token, start) pairs, in the order they ran."""
    real = host.runner.step
    calls: Calls = []

    def step(rows: Sequence[StepRow]) -> list[int]:
        calls.append([(tuple(row.token_ids), row.start) for row in rows])
        error = fails(rows)
        if error is not None:
            raise error
        return real(rows)

    monkeypatch.setattr(host.runner, "step", step)
    return calls


def prefills(rows: Sequence[StepRow]) -> list[list[int]]:
    return [list(row.token_ids) for row in rows if row.start == 0]


def raising_on(prompt: list[int], error: Callable[[], BaseException]) -> Fails:
    return lambda rows: error() if prompt in prefills(rows) else None


def recorded_health(
    engine: InProcessEngine, monkeypatch: pytest.MonkeyPatch
) -> list[BaseException | None]:
    """What health hears of each of the model's steps from now on (None: a success)."""
    heard: list[BaseException | None] = []
    monkeypatch.setattr(engine.core.health, "record", lambda error, model="": heard.append(error))
    return heard


async def lone_tokens(engine: InProcessEngine, prompt: list[int]) -> list[int]:
    return (await generate(engine, prompt, TOKENS)).token_ids


async def decoding_then(
    engine: InProcessEngine, joiners: list[list[int]]
) -> tuple[list[int], list[object]]:
    """DECODING's tokens, and each joiner's result (its tokens, or its exception), the
    joiners submitted together once DECODING has its first token (so they join a step in
    which it decodes)."""
    stream = engine.stream(submit(engine, DECODING, TOKENS))
    first = await anext(stream)
    joined = [
        asyncio.create_task(collect(engine.stream(submit(engine, prompt, TOKENS))))
        for prompt in joiners
    ]
    rest = await collect(stream)
    results = await asyncio.gather(*joined, return_exceptions=True)
    tokens = [*first.payload.token_ids, *rest.token_ids]  # type: ignore[union-attr]
    return tokens, [r if isinstance(r, BaseException) else r.token_ids for r in results]


async def test_a_prompt_the_model_throws_on_fails_alone_beside_decoding_sequences(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poison prompt's prefill failed the step: the sequence decoding in it and the
    healthy prompt joining with it failed too (500), and health counted a failure."""
    engine = await started(single_steps(tiny_causal_lm))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    try:
        decoding, healthy = await lone_tokens(engine, DECODING), await lone_tokens(engine, HEALTHY)
        heard = recorded_health(engine, monkeypatch)
        calls = failing_steps(host, monkeypatch, raising_on(POISON, lambda: ValueError("x")))
        tokens, (healthy_result, poison_result) = await decoding_then(engine, [HEALTHY, POISON])
    finally:
        await engine.close()
    joint = [(tuple(HEALTHY), 0), (tuple(POISON), 0)]
    assert joint in calls, "the premise: one prefill, in a step where DECODING decodes"
    assert tokens == decoding
    assert healthy_result == healthy
    assert isinstance(poison_result, EngineRefused)
    assert "could not process the prompt (ValueError)" in str(poison_result)
    # Where its log line is: under the request's reference, its number at its front end.
    assert re.search(r"the server logged why under request \d+@inprocess$", str(poison_result))
    assert [error for error in heard if error is not None] == []


async def test_joiners_that_fail_together_are_prefilled_alone(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a sequence decoding (no known-good rows): a joiner that computes alone shows
    the server computes, so the poison prompt is its own fault; the other joiner is
    answered."""
    engine = await started(single_steps(tiny_causal_lm))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    try:
        healthy = await lone_tokens(engine, HEALTHY)
        heard = recorded_health(engine, monkeypatch)
        calls = failing_steps(host, monkeypatch, raising_on(POISON, lambda: ValueError("x")))
        results = await asyncio.gather(
            collect(engine.stream(submit(engine, POISON, TOKENS))),
            collect(engine.stream(submit(engine, HEALTHY, TOKENS))),
            return_exceptions=True,
        )
    finally:
        await engine.close()
    assert calls[0] == [(tuple(POISON), 0), (tuple(HEALTHY), 0)], "the premise: one prefill"
    poison_result, healthy_result = results
    assert isinstance(poison_result, EngineRefused)
    assert not isinstance(healthy_result, BaseException) and healthy_result.token_ids == healthy
    assert [error for error in heard if error is not None] == []


def out_of_memory() -> BaseException:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


async def test_a_prefill_out_of_memory_prefills_its_joiners_one_at_a_time(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory prefilling several prompts at once: each alone fits. Every sequence of
    the step failed (500) and health counted it."""
    engine = await started(single_steps(tiny_causal_lm))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    try:
        decoding = await lone_tokens(engine, DECODING)
        alone = [await lone_tokens(engine, p) for p in (HEALTHY, LONGEST)]
        heard = recorded_health(engine, monkeypatch)
        calls = failing_steps(
            host, monkeypatch, lambda rows: out_of_memory() if len(prefills(rows)) > 1 else None
        )
        tokens, results = await decoding_then(engine, [LONGEST, HEALTHY])
    finally:
        await engine.close()
    assert any(len(prefills_of(call)) == 2 for call in calls), "the premise: a joint prefill"
    assert tokens == decoding
    assert results == alone[::-1]
    assert [error for error in heard if error is not None] == []


async def test_a_poison_prompt_in_a_step_out_of_memory_is_its_own_fault(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The joiners are prefilled alone after the step ran out of memory: the poison prompt
    failing alone is its own fault (400), not the server's out of memory (500, with the
    longer joiner after it never run), and the others are served."""
    engine = await started(single_steps(tiny_causal_lm))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)

    def fails(rows: Sequence[StepRow]) -> BaseException | None:
        joint = prefills(rows)
        if len(joint) > 1:
            return out_of_memory()
        return ValueError("the model throws on it") if POISON in joint else None

    try:
        decoding, longest = await lone_tokens(engine, DECODING), await lone_tokens(engine, LONGEST)
        heard = recorded_health(engine, monkeypatch)
        failing_steps(host, monkeypatch, fails)
        tokens, (poison_result, longest_result) = await decoding_then(engine, [POISON, LONGEST])
    finally:
        await engine.close()
    assert tokens == decoding
    assert isinstance(poison_result, EngineRefused)
    assert longest_result == longest
    assert [error for error in heard if error is not None] == []


def prefills_of(call: list[tuple[tuple[int, ...], int]]) -> list[tuple[int, ...]]:
    return [tokens for tokens, start in call if start == 0]


async def test_a_prompt_out_of_memory_alone_fails_as_the_server_s_and_alone(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt too long for the memory left fails (500: the server's, counted once), the
    shorter joiner and the decoding sequence beside it go on."""
    engine = await started(single_steps(tiny_causal_lm))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    try:
        decoding, healthy = await lone_tokens(engine, DECODING), await lone_tokens(engine, HEALTHY)
        heard = recorded_health(engine, monkeypatch)
        failing_steps(host, monkeypatch, raising_on(LONGEST, out_of_memory))
        tokens, (longest_result, healthy_result) = await decoding_then(engine, [LONGEST, HEALTHY])
    finally:
        await engine.close()
    assert tokens == decoding
    assert healthy_result == healthy
    assert isinstance(longest_result, BatchFailed)
    failures = [error for error in heard if error is not None]
    assert len(failures) == 1 and isinstance(failures[0], torch.OutOfMemoryError)


async def test_a_step_failed_on_the_server_s_side_answers_no_exception_text(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The 500's message says what failed, that it is the server's fault, and the request's
    reference, under which the engine's log holds the exception's text; the text itself (the
    model's words: anything) stays in that log. It was `generation step failed: <text>`."""
    engine = await started(single_steps(tiny_causal_lm))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    words = "CUDA out of memory. Tried to allocate 2.00 GiB; the model's own words"
    failing_steps(host, monkeypatch, raising_on(LONGEST, lambda: torch.OutOfMemoryError(words)))
    try:
        with caplog.at_level(logging.ERROR, logger="app.engine"):
            (result,) = await asyncio.gather(
                collect(engine.stream(submit(engine, LONGEST, TOKENS))), return_exceptions=True
            )
    finally:
        await engine.close()
    assert isinstance(result, BatchFailed) and not isinstance(result, DeviceLost)
    message = str(result)
    assert "Tried to allocate" not in message and "own words" not in message
    assert "failed computing a generation step of this request (OutOfMemoryError)" in message
    assert "a fault of the server's, not of the request" in message
    found = re.search(r"the server logged why under request (\d+@inprocess)$", message)
    assert found is not None
    logged = [r.getMessage() for r in caplog.records if f"request {found[1]} " in r.getMessage()]
    assert len(logged) == 1 and f"OutOfMemoryError: {words}" in logged[0]


async def test_a_lost_device_is_not_retried(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sticky CUDA error leaves the context unusable: nothing runs again after it, every
    sequence of the step fails (500) and health hears of it once."""
    engine = await started(single_steps(tiny_causal_lm))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    lost = RuntimeError("CUDA error: an illegal memory access was encountered")
    slots_taken: list[object] = []

    async def take_slot() -> None:
        slots_taken.append(object())

    try:
        heard = recorded_health(engine, monkeypatch)
        calls = failing_steps(host, monkeypatch, raising_on(POISON, lambda: lost))
        # Its answer waits for no compute slot (another batch may hold one, on the dead
        # device, and tell health first: its requests would be named the cause).
        monkeypatch.setattr(host._steps, "take_slot", take_slot)
        with pytest.raises(DeviceLost):  # 500 device_lost, not 503 engine_lost
            await decoding_then(engine, [POISON])
    finally:
        await engine.close()
    failed_at = next(i for i, call in enumerate(calls) if (tuple(POISON), 0) in call)
    assert calls[failed_at + 1 :] == []
    assert [error for error in heard if error is not None] == [lost]
    assert slots_taken == []


async def test_a_joiner_past_its_deadline_is_not_run_again_and_is_answered_504(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed step took the healthy joiner past its deadline: it is not prefilled
    alone for nobody, and is answered as expired, not as failed (500)."""
    clock = ManualClock(1000.0)
    engine, host = await started_on_clock(tiny_causal_lm, clock)

    def poison_then_late(rows: Sequence[StepRow]) -> BaseException | None:
        if POISON in prefills(rows):
            clock.now = 1011.0  # the step took the healthy joiner past its deadline
            return ValueError("x")
        return None

    calls = failing_steps(host, monkeypatch, poison_then_late)

    def request(prompt: list[int], deadline: float) -> Submit:
        return Submit(engine.next_request_id(), "tiny", deadline, GeneratePayload(prompt, TOKENS))

    try:
        results = await asyncio.gather(
            collect(engine.stream(request(HEALTHY, 1010.0))),
            collect(engine.stream(request(POISON, 2000.0))),
            return_exceptions=True,
        )
    finally:
        await engine.close()
    assert calls[0] == [(tuple(HEALTHY), 0), (tuple(POISON), 0)], "the premise: one prefill"
    healthy_result, poison_result = results
    assert isinstance(healthy_result, DeadlineExceeded)
    assert (tuple(HEALTHY), 0) not in [row for call in calls[1:] for row in call]
    assert isinstance(poison_result, BatchFailed)  # nothing computed alone: the server's
