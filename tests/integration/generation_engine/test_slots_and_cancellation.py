"""The engine's KV-cache slots, with the tiny random-weight causal LM: a full cache
refuses 429 and a cancel frees a slot at once, also a Cancel read with its Submit; a dead
front end's sequences free theirs; sequences waiting for a slot stay out of the backlog
front ends shed on."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from app.admission import Rejected, RejectReason
from app.engine.core import EngineCore
from app.engine.generation_host import GenerationHost
from app.engine.identity import frontend_identity
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import (
    FinishReason,
    FromEngine,
    GeneratePayload,
    Output,
    SamplingParams,
    Submit,
)
from app.metrics import Metrics
from app.models.causal_lm import StepRow
from tests.support.generation_engine import (
    SLOT_TOKENS,
    generate,
    settings_for,
    started,
    submit,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_a_full_cache_refuses_429_and_cancel_frees_it_at_once(tiny_causal_lm: Path) -> None:
    """One slot: while a long sequence holds it, a request needing the whole slot is refused
    429 with Retry-After (its wait is far over the 1 ms budget); once the long one is
    cancelled after its first token, its slot is free at once, while the multi-step run
    computing its row is still held in the model (so not at the run's end), and the same
    request is then admitted and completes."""
    engine = await started(
        settings_for(
            tiny_causal_lm,
            generate_slots=1,
            max_queue_delay_ms=1,
            # The cancel arrives while a long multi-step run computes the cancelled row.
            generate_steps_per_dispatch=64,
        )
    )
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    real_step = host.runner.step
    steps = 0
    in_the_run = threading.Event()  # the decode run after the prefill is in the model
    let_it_go = threading.Event()

    def held_after_the_prefill(rows: Sequence[StepRow]) -> list[int]:
        """Compute thread: the first step (the prefill) runs; the next waits for the test."""
        nonlocal steps
        steps += 1
        if steps > 1:
            in_the_run.set()
            let_it_go.wait(timeout=60)
        return real_step(rows)

    host.runner.step = held_after_the_prefill  # type: ignore[method-assign]
    try:
        prompt = [1, 40, 41, 42]
        request = Submit(
            engine.next_request_id(),
            "tiny",
            time.monotonic() + 120,
            GeneratePayload(prompt, SamplingParams(max_new_tokens=SLOT_TOKENS - len(prompt))),
        )
        whole_slot = SamplingParams(max_new_tokens=SLOT_TOKENS - 20)
        stream = engine.stream(request)
        await anext(stream)
        assert await asyncio.to_thread(in_the_run.wait, 60), "the decode run never started"
        with pytest.raises(Rejected) as refused:
            await generate(engine, list(range(10, 30)), whole_slot)
        assert refused.value.reason is RejectReason.QUEUE
        assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
        await stream.aclose()  # the client went away: Cancel
        # The engine handles the Cancel in its next loop turns; the run stays in the model.
        # (In-process, `debug` can answer without a turn of the loop: Python 3.12's wait_for
        # takes a queued reply at once, so the loop gets its turns here.)
        for _ in range(1000):
            report = (await engine.debug("pool"))["tiny"]
            if report["slots_held"] == 0:  # type: ignore[index]
                break
            await asyncio.sleep(0)  # one turn of the loop, not a wait for time
        assert report["slots_held"] == 0, report  # type: ignore[index]
        assert not let_it_go.is_set()  # freed while its run was still computing
        let_it_go.set()
        whole = await generate(engine, list(range(10, 30)), whole_slot)
        assert len(whole.token_ids) == SLOT_TOKENS - 20 or whole.finish_reason is FinishReason.EOS
    finally:
        let_it_go.set()
        await engine.close()


async def yield_until(condition: object, what: str) -> None:
    """Yield to the event loop until `condition()` holds (bounded: fails, never hangs)."""
    for _ in range(1000):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def test_a_cancel_read_in_the_same_turn_as_its_submit_drops_the_sequence(
    tiny_causal_lm: Path,
) -> None:
    """The engine reads a front end's Submit and Cancel in one turn when its loop was busy:
    the request's task is cancelled before it ever runs, and its sequence used to stay
    queued, then take a slot and generate for nobody."""
    engine = await started(settings_for(tiny_causal_lm, generate_slots=1))
    try:
        holder = engine.stream(submit(engine, [1, 40, 41], SamplingParams(max_new_tokens=200)))
        await anext(holder)  # the only slot is taken: the next request waits
        core, host = engine.core, engine.core.hosts["tiny"]
        request = submit(engine, [1, 50, 51], SamplingParams(max_new_tokens=3))
        core.submit(b"front", request, lambda message: None)
        assert host.queued_inputs() == 1
        core.cancel(b"front", request.request_id)  # same turn: its task has not run
        await yield_until(lambda: host.queued_inputs() == 0, "the cancelled sequence dropped")
        await holder.aclose()
    finally:
        await engine.close()


async def test_a_dead_front_ends_sequences_free_their_slots_and_its_count_is_forgotten(
    tiny_causal_lm: Path,
) -> None:
    """A front end that dies sends no Cancel: its sequences kept their KV-cache slots and
    stepped on until their deadline. Told it is gone (`FrontEndGone`, by the supervisor),
    the engine drops them and forgets what that front end sent; other front ends' work
    goes on."""
    core = EngineCore(settings_for(tiny_causal_lm, warmup=False), Metrics())
    engine = InProcessEngine(core)
    await engine.start()
    await engine.wait_ready()
    dead, alive = frontend_identity(4242, 1), frontend_identity(4343, 1)
    outputs: dict[bytes, list[FromEngine]] = {dead: [], alive: []}
    first_output, alive_finished = asyncio.Event(), asyncio.Event()

    def emit_to(origin: bytes) -> Callable[[FromEngine], None]:
        def emit(message: FromEngine) -> None:
            outputs[origin].append(message)
            first_output.set()
            if origin == alive and isinstance(message, Output) and message.final:
                alive_finished.set()

        return emit

    try:
        for origin in (dead, alive):
            request = Submit(
                1,  # ids are unique per front end: the same id from two is two requests
                "tiny",
                time.monotonic() + 120,
                GeneratePayload([1, 40, 41], SamplingParams(max_new_tokens=SLOT_TOKENS - 4)),
            )
            core.submit(origin, request, emit_to(origin))
        await first_output.wait()
        host = core.hosts["tiny"]
        assert host.debug_report()["slots_held"] == 2
        assert set(core.status().taken_inputs) == {dead, alive}
        core.frontend_gone(4242, 1)
        assert set(core.status().taken_inputs) == {alive}
        # Freed as its task's cancellation completes (the next turn of the loop).
        await yield_until(lambda: host.debug_report()["slots_held"] == 1, "the slot freed")
        emitted_to_the_dead = len(outputs[dead])
        # A Submit it sent before dying, read after the notice (the engine's socket takes
        # one message from each peer in turn): dropped, uncounted, unanswered.
        late = Submit(
            2, "tiny", time.monotonic() + 120, GeneratePayload([1, 40], SamplingParams(4))
        )
        core.submit(dead, late, emit_to(dead))
        assert set(core.status().taken_inputs) == {alive}
        assert host.debug_report()["slots_held"] == 1
        await asyncio.wait_for(alive_finished.wait(), 60)  # the other goes on to its end
        assert len(outputs[dead]) == emitted_to_the_dead
    finally:
        await engine.close()


async def test_sequences_waiting_for_a_cache_slot_add_nothing_to_the_shared_backlog(
    tiny_causal_lm: Path,
) -> None:
    """Front ends shed every model's requests on the published backlog; a sequence waiting
    for a KV-cache slot delays only generate requests, so it must not show there."""
    engine = await started(settings_for(tiny_causal_lm, generate_slots=1))
    try:
        long = Submit(
            engine.next_request_id(),
            "tiny",
            time.monotonic() + 120,
            GeneratePayload([1, 40, 41], SamplingParams(max_new_tokens=200)),
        )
        running = engine.stream(long)
        await anext(running)
        waiting = asyncio.create_task(
            generate(engine, [1, 50, 51], SamplingParams(max_new_tokens=3))
        )
        for _ in range(100):  # until the second request waits in the engine
            if engine.core.queued_inputs() == 1:
                break
            await asyncio.sleep(0)
        assert engine.core.queued_inputs() == 1
        status = engine.status()
        assert status is not None
        assert status.queued_inputs == 0  # front ends count these in embedding batches
        assert status.backlog_s == 0.0
        assert status.seconds_per_input == 0.0  # nor does each generate request sent
        assert status.least_own_compute_s == 0.0  # nor its admission, on top of the backlog
        await running.aclose()
        assert len((await waiting).token_ids) == 3
    finally:
        await engine.close()
