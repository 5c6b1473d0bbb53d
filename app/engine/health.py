"""Pure run-time health: an engine whose batches keep failing is unhealthy.

Start-up failures are reported separately; this watches the batches afterwards (a device
lost, a driver fault, a model that throws on every input, or computes NaN for it: a batch
whose every embedding row is non-finite counts as failed, `Batcher.rows_failed`). Failures
are counted per model:
after `threshold` consecutive failed batches of one model the engine reports unhealthy,
naming that model, /healthz answers 503 and Kubernetes restarts the pod; a successful batch
of that model clears its count, and only its own. A single count for the whole engine let
another model's successes (a generate model's steps, every few ms) reset it, so a model that
failed every batch answered 500 for ever behind a healthy /healthz while others served.

A batch that failed with a sticky CUDA error (a device-side assert, an illegal memory
access, ...) is different: the process's CUDA context is unusable from then on, for every
model, every later batch fails the same way and nothing clears it, so health is lost at
once, for good, and `on_device_lost` is called (the engine process exits once that batch's
requests are answered, so that its supervisor starts a fresh one: `engine/process.py`).
Each flip of health is logged, once (`VerdictLog`). Engine event loop thread only;
torch-free.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

# Defined on the batcher's side (its triage asks too: imports point one way), and still
# importable from here, where the engine's code looked for it.
from app.failures import device_lost
from app.log_limits import VerdictLog

log = logging.getLogger(__name__)

BatchRecorder = Callable[[BaseException | None], None]


class BatchHealth:
    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        # Consecutive failed batches and the last one's exception class, by model (only
        # models whose last batch failed); "" is a recorder that names no model.
        self._failures: dict[str, tuple[int, str]] = {}
        self.lost_device = False
        self._lost_by: BaseException | None = None  # the failure that lost it
        # Called once, when a batch fails with a sticky device error (`device_lost`).
        self.on_device_lost: Callable[[], None] = lambda: None
        self._verdict = VerdictLog(log, "engine health", assumed="healthy")

    def record(self, error: BaseException | None, model: str = "") -> None:
        """Called once per finished batch of `model`, with its exception if it failed."""
        if error is None:
            if self._failures.pop(model, None) is not None:
                self._note()
            return
        count, _ = self._failures.get(model, (0, ""))
        self._failures[model] = (count + 1, type(error).__name__)
        if not self.lost_device and device_lost(error):
            self.lost_device = True
            self._lost_by = error
            self._note()  # before the process exits on it
            self.on_device_lost()
            return
        self._note()

    def _note(self) -> None:
        healthy = self.healthy
        self._verdict.note("healthy" if healthy else "unhealthy", None if healthy else self.problem)

    def lost_device_before(self, error: BaseException) -> bool:
        """Whether the device was lost by a failure other than `error`: `error` is then a
        batch's that failed of it beside the one that lost it, whose requests are answered
        as the exit leaves the rest (503 `engine_lost`), not 500 `device_lost` (that batch's
        own, whose input may be the cause). Asked before or after `error` is recorded."""
        return self._lost_by is not None and self._lost_by is not error

    def recorder(self, model: str) -> BatchRecorder:
        """What `model`'s host calls once per batch (its `EngineContext.record_batch`)."""

        def record(error: BaseException | None) -> None:
            self.record(error, model)

        return record

    @property
    def consecutive_failures(self) -> int:
        """The most consecutive failed batches of any one model."""
        return max((count for count, _ in self._failures.values()), default=0)

    @property
    def healthy(self) -> bool:
        return not self.lost_device and self.consecutive_failures < self.threshold

    @property
    def problem(self) -> str | None:
        if self.lost_device:
            return "the device's CUDA context is unusable (a sticky CUDA error)"
        failing = [
            f"{count} consecutive batches failed ({error})"
            if not model
            else f"model {model!r}: {count} consecutive batches failed ({error})"
            for model, (count, error) in sorted(self._failures.items())
            if count >= self.threshold
        ]
        return "; ".join(failing) or None
