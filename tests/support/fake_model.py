"""A stand-in model for tests whose point is scheduling, not the result.

Its forward pass blocks on a gate the test controls, so tests decide exactly when a batch
finishes instead of sleeping; it records every batch it ran.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from app.model_specs import ModelSpec


class GatedRunner:
    task = "embed"
    dtype = torch.float32
    device = torch.device("cpu")
    max_input_tokens = 64
    output_width = 4
    pad_token_id = 0

    def __init__(self, name: str) -> None:
        self.name = name
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Semaphore(0)
        self.batches: list[list[list[int]]] = []
        self.batch_threads: list[str] = []  # the compute thread of each recorded batch
        self.out_of_memory_above_rows: int | None = None
        self.failure: Exception | None = None  # raised by every batch while set
        self.failed_batches = 0
        self.busy_s = 0.0  # simulated compute time of every batch, after the gate opens
        self.cold_s = 0.0  # simulated set-up time of the first batch at each shape
        self._shapes_run: set[tuple[int, ...]] = set()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rows = [
            [int(t) for t, m in zip(ids, mask, strict=True) if m]
            for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True)
        ]
        if self.failure is not None:
            self.failed_batches += 1
            raise self.failure
        real_rows = [r for r in rows if r != [self.pad_token_id]]
        if self.out_of_memory_above_rows and len(real_rows) > self.out_of_memory_above_rows:
            raise torch.OutOfMemoryError("fake: batch too large for the device")
        self.batches.append(rows)
        self.batch_threads.append(threading.current_thread().name)
        self.started.release()
        self.gate.wait(timeout=30)
        if self.cold_s and tuple(input_ids.shape) not in self._shapes_run:
            time.sleep(self.cold_s)
        self._shapes_run.add(tuple(input_ids.shape))
        if self.busy_s:
            time.sleep(self.busy_s)
        kept = (input_ids * attention_mask).float()
        return torch.stack(
            [kept.sum(1), attention_mask.sum(1).float(), kept.max(1).values, kept[:, 1]], dim=1
        )


class WordLengthTokenizer:
    """One token per word, id = word length: distinct, checkable outputs. No limit check,
    so tests can send what the engine itself must refuse."""

    max_input_tokens = GatedRunner.max_input_tokens
    pad_token_id = GatedRunner.pad_token_id

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        return [[1] + [len(w) for w in text.split()] + [2] for text in texts]


class GatedLoader:
    """A `RunnerLoader` handing out one `GatedRunner` per model; `loaded` gates loading.
    `tokenizer` is the matching front-end tokenizer loader."""

    def __init__(self, cold_s: float = 0.0) -> None:
        """`cold_s`: each runner's simulated set-up time at a shape's first batch."""
        self.runners: dict[str, GatedRunner] = {}
        self.loaded = threading.Event()
        self.loaded.set()
        self.cold_s = cold_s

    def __call__(self, spec: ModelSpec, device: torch.device, largest: int) -> GatedRunner:
        self.loaded.wait(timeout=30)
        runner = GatedRunner(spec.name)
        runner.cold_s = self.cold_s
        self.runners[spec.name] = runner
        return runner

    def tokenizer(self, spec: ModelSpec, largest: int) -> WordLengthTokenizer:
        return WordLengthTokenizer()
