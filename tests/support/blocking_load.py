"""An engine whose model load blocks until the test releases it: how a stop while loading
is tested, in the test's process (`BlockingLoader`), or in an engine process whose load
never returns (`blocking_core`, a `CoreFactory` once `entered`, a spawn context's event, is
bound by a partial)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

import torch

from app.metrics import Metrics
from app.model_specs import ModelSpec
from app.settings import Settings
from tests.support.fake_model import GatedRunner

if TYPE_CHECKING:
    from app.engine.core import EngineCore


class Signal(Protocol):
    """A threading or multiprocessing event."""

    def set(self) -> None: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class BlockingLoader:
    """A `RunnerLoader` that says it has `entered` the load, then waits for `release`."""

    def __init__(self, entered: Signal, release: Signal) -> None:
        self.entered = entered
        self.release = release
        self.returned = False  # the load ended: `release` was set

    def __call__(self, spec: ModelSpec, device: torch.device, largest: int) -> GatedRunner:
        self.entered.set()
        self.release.wait()
        self.returned = True
        return GatedRunner(spec.name)


def blocking_core(entered: Signal, settings: Settings, metrics: Metrics) -> EngineCore:
    """A core whose load waits for an event of its process's own, never set: not one the
    test sets, as a multiprocessing event's `set` waits for every waiter to wake, and the
    engine process exits with its load waiting."""
    from app.engine.core import EngineCore

    return EngineCore(settings, metrics, loader=BlockingLoader(entered, threading.Event()))
