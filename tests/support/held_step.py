"""A runner's `step` held at one call: the test learns when that call starts (`reached`) and
lets it compute when it says (`release`), to act (cancel, check a slot) while a known step
is in flight on the compute thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from app.models.causal_lm import StepRow


class HeldStep:
    """Wraps `runner.step`; its `at`-th call waits for `release` (60 s at most) before it
    computes. Any thread."""

    def __init__(self, runner: Any, at: int) -> None:
        self._step = runner.step
        self._at = at
        self._calls = 0
        self.reached = threading.Event()
        self.released = threading.Event()

    def __call__(self, rows: Sequence[StepRow]) -> list[int]:
        self._calls += 1
        if self._calls == self._at:
            self.reached.set()
            self.released.wait(timeout=60)
        result: list[int] = self._step(rows)
        return result

    def release(self) -> None:
        self.released.set()


@contextmanager
def held_step(runner: Any, at: int) -> Iterator[HeldStep]:
    """`runner.step` held at its `at`-th call while the block runs; released (and the
    runner's own step put back) when it ends, however it ends."""
    held = HeldStep(runner, at)
    runner.step = held
    try:
        yield held
    finally:
        held.release()
        runner.step = held._step
