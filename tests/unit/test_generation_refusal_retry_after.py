"""A generate request refused because `generate_max_waiting` sequences already wait for a
KV-cache slot says when to retry (ARCHITECTURE §11: every 429 carries Retry-After), even
before the engine has measured a step (STEADY_WARMUP=false): the front end pauses that
connection's reads until then (api/shedding_protocol.py), which it cannot without one."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from app.admission import Rejected, RejectReason
from app.engine.core import EngineCore
from app.engine.generation_host import GenerationHost
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import GeneratePayload, SamplingParams, Submit
from app.metrics import Metrics
from app.models.causal_lm import StepRow
from tests.support.generation_engine import settings_for


async def test_a_refusal_before_any_step_was_measured_still_says_when_to_retry(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = EngineCore(
        settings_for(tiny_causal_lm, warmup=False, generate_slots=1, generate_max_waiting=1),
        Metrics(),
    )
    engine = InProcessEngine(core)
    await engine.start()
    await engine.wait_ready()
    host = core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    monkeypatch.setattr(host, "_record_step", lambda result: None)  # no step time, ever
    real_step = host.runner.step
    in_the_model = threading.Event()
    let_it_go = threading.Event()

    def held(rows: Sequence[StepRow]) -> list[int]:
        """Compute thread: the first sequence's prefill holds the one slot until released."""
        in_the_model.set()
        let_it_go.wait(timeout=60)
        return real_step(rows)

    monkeypatch.setattr(host.runner, "step", held)

    def request() -> Submit:
        return Submit(
            engine.next_request_id(),
            "tiny",
            time.monotonic() + 120,
            GeneratePayload([1, 40, 41], SamplingParams(max_new_tokens=4)),
        )

    holding = engine.stream(request())
    waiting = engine.stream(request())
    first = asyncio.create_task(anext(holding))
    second: asyncio.Task[object] | None = None
    try:
        assert await asyncio.to_thread(in_the_model.wait, 60), "the first step never started"
        second = asyncio.create_task(anext(waiting))
        for _ in range(1000):  # until the second sequence waits for the slot
            if len(host._batch.waiting) == 1:
                break
            await asyncio.sleep(0)
        assert len(host._batch.waiting) == 1
        assert host._step_s == 0.0
        with pytest.raises(Rejected) as refused:
            await anext(engine.stream(request()))
        assert refused.value.reason is RejectReason.QUEUE
        assert "cap generate_max_waiting=1" in refused.value.message
        assert refused.value.retry_after_header == "1"
    finally:
        let_it_go.set()
        for task in (first, second):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await holding.aclose()
        await waiting.aclose()
        await engine.close()
