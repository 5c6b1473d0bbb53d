"""How the batcher answers the rows of a failed batch (`app/batch_rerun.py`): the time a
row answered after its batch failed is accounted as compute, and the batching layer imports
nothing of the engine but its messages."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.batcher import Batcher
from app.compute_slots import ComputeSlots
from app.execute import SlotTimings
from app.failures import InputFailed
from app.metrics import Metrics
from app.scheduler import BatchPolicy, BatchShape
from tests.support.inline_batching import InlineDispatcher

BAD = -1
APP = Path(__file__).resolve().parents[2] / "app"


def test_triage_and_the_batcher_import_nothing_of_the_engine_but_its_messages() -> None:
    """Imports point one way: the engine uses the batcher, never the reverse. Triage
    imported `engine.health` (for `device_lost`, now in `app/failures.py`); the messages
    of `engine/protocol.py`, shared by the front ends and the engine, are the exception."""
    for module in ("batch_triage", "batch_rerun", "batcher", "batch_trace", "failures"):
        tree = ast.parse((APP / f"{module}.py").read_text())
        imported = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module is not None
        } | {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        engine = {name for name in imported if name.startswith("app.engine")}
        assert engine <= {"app.engine.protocol"}, (module, engine)


async def test_a_row_answered_after_its_batch_failed_spent_that_batch_computing() -> None:
    """The failed batch's 200 ms (and the triage's run of the other row) was counted as
    the row's queue wait: its slow-request report blamed queueing on an idle queue."""
    now = [100.0]

    @dataclass(frozen=True)
    class Computed:
        rows: Sequence[int]
        timings: SlotTimings

        def row(self, index: int) -> int:
            return 2 * self.rows[index]

    def execute(shape: BatchShape, rows: Sequence[int]) -> Computed:
        seconds = 0.2 if len(rows) > 1 else 0.01
        now[0] += seconds  # the compute thread's time passes on the injected clock
        if len(rows) > 1 or BAD + 10 in rows:
            raise IndexError("index out of range")
        return Computed(rows, SlotTimings(compute_s=seconds, acquire_wait_s=0.0, pool_miss=False))

    batcher: Batcher[int, int] = Batcher(
        "m",
        BatchPolicy(length_buckets=(16,), max_batch_size=4, max_batch_tokens=64, max_wait_s=0.0),
        execute,
        length_of=lambda row: row,
        dispatcher=InlineDispatcher(),  # type: ignore[arg-type]
        slots=ComputeSlots(1),
        metrics=Metrics(),
        clock=lambda: now[0],
    )
    good, bad = batcher.submit([5, BAD + 10], deadline=now[0] + 10)
    batcher.start()
    answered = await asyncio.wait_for(good, timeout=10)
    with pytest.raises(InputFailed) as failed:
        await bad
    # What the model raised, traceback and all, for the engine's log (never the client's).
    assert isinstance(failed.value.__cause__, IndexError)
    assert failed.value.__cause__.__traceback__ is not None
    await batcher.close()
    assert answered.value == 10
    assert answered.queue_wait_s == pytest.approx(0.0)  # its batch started at once
    # The failed batch, the bad row's run alone, its own: all compute.
    assert answered.compute_s == pytest.approx(0.22)
    assert answered.batch is not None
    assert answered.batch.failed_batch_s == pytest.approx(0.21)
