"""The engine side of the front-end cost bench (`loadtest/null_engine.py`): the real engine
core (`app.engine.core.EngineCore`: admission, batching, buffer pools, compute threads,
status) with a model that computes nothing, served by the real engine process
(`app.engine.process`, ZeroMQ) through its `CoreFactory` seam. So the front end measured
against it does everything it does against a real model (encode, send, receive, decode, the
status stream) while the engine answers as fast as it can.

Imported by the engine process only (torch), through `loadtest.null_engine.null_engine_core`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from app.engine.core import EngineCore
from app.metrics import Metrics
from app.model_queues import ModelWork
from app.model_specs import ModelSpec
from app.settings import Settings
from loadtest.null_engine import MAX_INPUT_TOKENS, WIDTH


class NullRunner:
    """A `ModelRunner` whose forward pass is zeros of the model's width: no compute."""

    task = "embed"
    device = torch.device("cpu")
    dtype = torch.float32
    max_input_tokens = MAX_INPUT_TOKENS
    output_width = WIDTH
    pad_token_id = 0

    def __init__(self, name: str) -> None:
        self.name = name

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros((input_ids.shape[0], WIDTH), dtype=torch.float32)


def load_null_runner(spec: ModelSpec, device: torch.device, largest: int) -> NullRunner:
    """A `RunnerLoader`: every embedding model is a `NullRunner`."""
    return NullRunner(spec.name)


class NullEngineCore(EngineCore):
    """The real core with null models, publishing a backlog of at least `backlog_s`: over
    the delay budget, every request is refused from its headers by the front end (and by
    this engine's own admission, should one reach it)."""

    def __init__(self, settings: Settings, metrics: Metrics, backlog_s: float) -> None:
        super().__init__(settings, metrics, load_null_runner)
        self._least_backlog_s = backlog_s

    def model_works(self) -> dict[str, ModelWork]:
        """Each model's work, with running batches of at least `backlog_s` on every compute
        thread: what each model's wait, and the whole engine's backlog, count."""
        least = self._least_backlog_s * self.slots.capacity
        return {
            name: replace(work, running_s=max(least, work.running_s))
            for name, work in super().model_works().items()
        }
