"""Warm-up builds every matrix-product shape serving meets (`StepRunner.warm_up`,
`app/models/token_buckets.py`): on a CPU, oneDNN builds a primitive per input shape, and the
first linear of a new row count pays 200-1100 us. Serving's steps (decode batches of any
size up to the slots, prefills of random rows x chunk lengths within
`generate_max_batch_tokens`) run their linears only on (rows, row stride, weight) shapes
warm-up ran;
the tiny causal LM, bf16, on the direct decoder. No timings asserted."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.compute_slots import ComputeSlots
from app.engine.generation_steps import StepResult, StepRunner
from app.engine.protocol import SamplingParams
from app.models.causal_lm import CausalLMRunner, StepRow
from app.models.sampling import new_generator
from app.settings import Settings

GREEDY = SamplingParams(max_new_tokens=1)
# A linear's input rows, the stride between them (oneDNN builds a primitive per layout too)
# and its weight's shape.
Shape = tuple[int, int, tuple[int, ...]]


@contextmanager
def linear_shapes() -> Iterator[set[Shape]]:
    """The (rows, row stride, weight shape) of every `F.linear` (the head's too) while
    open."""
    seen: set[Shape] = set()
    linear = torch.nn.functional.linear

    def recorded(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> Any:
        stride = x.stride(-2) if x.dim() > 1 else x.shape[-1]
        seen.add((x.numel() // x.shape[-1], stride, tuple(weight.shape)))
        return linear(x, weight, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "linear", recorded)
        yield seen


def step_runner(runner: CausalLMRunner, settings: Settings) -> StepRunner:
    """A `StepRunner` whose steps run `runner.step` at once (no dispatcher, no slots)."""
    context = SimpleNamespace(
        settings=settings,
        clock=lambda: 0.0,
        metrics=SimpleNamespace(dispatcher_busy=SimpleNamespace(labels=lambda name: None)),
        slots=ComputeSlots(1),
    )
    steps = StepRunner(runner, context, asyncio.Event())  # type: ignore[arg-type]

    async def run(rows: list[StepRow]) -> StepResult:
        return StepResult([[token] for token in runner.step(rows)], 0.0, 1)

    steps.run = run  # type: ignore[method-assign]
    return steps


def serve(runner: CausalLMRunner, settings: Settings, steps: int, seed: int) -> None:
    """Random steps as serving runs them: decode batches of 1..slots rows, prefills of rows
    of up to a chunk each, rows x longest within `generate_max_batch_tokens` (the first
    row always runs)."""
    draw = random.Random(seed)
    slots = runner.cache.shape.slots
    longest = runner.max_sequence_tokens - 1
    chunk = min(settings.generate_prefill_chunk_tokens, longest)
    for _ in range(steps):
        if draw.random() < 0.3:
            rows = draw.randint(1, slots)
            runner.step(
                [
                    StepRow(s, [5], draw.randint(1, longest - 1), GREEDY, new_generator(0))
                    for s in range(rows)
                ]
            )
            continue
        lengths = [draw.randint(1, chunk)]
        while len(lengths) < slots and draw.random() < 0.8:
            length = draw.randint(1, chunk)
            if max(*lengths, length) * (len(lengths) + 1) > settings.generate_max_batch_tokens:
                break
            lengths.append(length)
        rows_fed = [
            StepRow(
                s, [5] * n, draw.randint(0, longest - n), GREEDY, new_generator(0), prefill=True
            )
            for s, n in enumerate(lengths)
        ]
        runner.step(rows_fed)


SMALL = {
    "generate_slots": 6,
    "generate_slot_tokens": 80,
    "generate_prefill_chunk_tokens": 24,
    "generate_max_batch_tokens": 100,
    "length_buckets": (16, 32, 64),
}


@pytest.mark.parametrize("overrides", [{}, SMALL], ids=["defaults", "small"])
async def test_serving_meets_no_linear_shape_warm_up_did_not_run(
    overrides: dict[str, Any], tiny_causal_lm: Path
) -> None:
    settings = Settings(**overrides)
    runner = CausalLMRunner(
        "tiny",
        str(tiny_causal_lm),
        torch.device("cpu"),
        torch.bfloat16,
        settings.generate_slots,
        settings.generate_slot_tokens,
    )
    assert runner._direct is not None
    steps = step_runner(runner, settings)
    done: list[int] = []
    with linear_shapes() as warmed:
        await steps.warm_up(lambda count, total: done.append(count))
    assert done == list(range(1, steps.warmup_total + 1))
    with linear_shapes() as served:
        serve(runner, settings, steps=150, seed=len(overrides))
    assert served - warmed == set()
