"""Fakes for driving a real `Batcher` on the event loop alone: a dispatcher that runs each
batch synchronously, within the step that awaits it (so the order is the loop's and
deterministic), what a fake model's batch computes (each row doubled), and a batcher of
int rows over them (`inline_batcher`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from app.batcher import Batcher, BatchExecutor
from app.compute_slots import ComputeSlots
from app.execute import SlotTimings
from app.metrics import Metrics
from app.scheduler import BatchPolicy

T = TypeVar("T")

TIMINGS = SlotTimings(compute_s=0.01, acquire_wait_s=0.0, pool_miss=False)


@dataclass(frozen=True)
class Computed:
    """A batch's result: row i computes to twice its value."""

    rows: Sequence[int]
    timings: SlotTimings = TIMINGS

    def row(self, index: int) -> int:
        return 2 * self.rows[index]


class InlineDispatcher:
    """Runs what a compute thread would, on the caller's event loop."""

    async def run_compute(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    async def run_on_every_compute_thread(self, fn: Callable[..., T], *args: Any) -> list[T]:
        return [fn(*args)]


def inline_batcher(
    model: BatchExecutor[int, int],
    slots: ComputeSlots,
    policy: BatchPolicy,
    on_batch_done: Callable[[BaseException | None], None] = lambda error: None,
    lost_device_before: Callable[[BaseException], bool] = lambda error: False,
) -> Batcher[int, int]:
    """A batcher of int rows (a row is its own length) over `InlineDispatcher`, its clock
    standing at 0."""
    return Batcher(
        "m",
        policy,
        model,
        length_of=lambda row: row,
        dispatcher=InlineDispatcher(),  # type: ignore[arg-type]
        slots=slots,
        metrics=Metrics(),
        clock=lambda: 0.0,
        on_batch_done=on_batch_done,
        lost_device_before=lost_device_before,
    )
