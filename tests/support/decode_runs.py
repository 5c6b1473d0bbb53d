"""Running `generation_runs.decode_run` without an engine: its hand-overs recorded, each
row's tokens gathered by slot. Any thread (the test's)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from app.engine.generation_runs import decode_run
from app.models.causal_lm import StepRow

HandOvers = list[tuple[list[int], list[list[int]], bool]]


def run_decode(
    runner: Any,
    rows: Sequence[StepRow],
    steps: int,
    each_step: frozenset[int] = frozenset(),
    handed: HandOvers | None = None,
) -> dict[int, list[int]]:
    """Each row's tokens of a `steps`-step run on `runner` (anything with `step` and
    `eos_token_ids`), by slot; every hand-over appended to `handed` when given."""
    record: HandOvers = [] if handed is None else handed

    def hand_over(slots: list[int], tokens: list[list[int]], continuing: bool) -> None:
        record.append((slots, tokens, continuing))

    decode_run(runner, rows, steps, hand_over, each_step, threading.Event(), threading.Event())
    gathered: dict[int, list[int]] = {}
    for slots, tokens, _ in record:
        for slot, chosen in zip(slots, tokens, strict=True):
            gathered.setdefault(slot, []).extend(chosen)
    return gathered
