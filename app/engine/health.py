"""Pure run-time health: an engine whose batches keep failing is unhealthy.

Start-up failures are reported separately; this watches the batches afterwards (a device
lost, a driver fault, a model that throws on every input). After `threshold` consecutive
failed batches the engine reports unhealthy, /healthz answers 503 and Kubernetes restarts
the pod; a single successful batch clears it.

A batch that failed with a sticky CUDA error (a device-side assert, an illegal memory
access, ...) is different: the process's CUDA context is unusable from then on, every later
batch fails the same way and nothing clears it, so health is lost at once, for good, and
`on_device_lost` is called (the engine process exits, so that its supervisor starts a fresh
one: `engine/process.py`). Engine event loop thread only; torch-free.
"""

from __future__ import annotations

from collections.abc import Callable

# Defined on the batcher's side (its triage asks too: imports point one way), and still
# importable from here, where the engine's code looked for it.
from app.failures import device_lost


class BatchHealth:
    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.lost_device = False
        # Called once, when a batch fails with a sticky device error (`device_lost`).
        self.on_device_lost: Callable[[], None] = lambda: None

    def record(self, error: BaseException | None) -> None:
        """Called once per finished batch, with its exception if it failed."""
        if error is None:
            self.consecutive_failures = 0
            self.last_error = None
            return
        self.consecutive_failures += 1
        self.last_error = type(error).__name__
        if not self.lost_device and device_lost(error):
            self.lost_device = True
            self.on_device_lost()

    @property
    def healthy(self) -> bool:
        return not self.lost_device and self.consecutive_failures < self.threshold

    @property
    def problem(self) -> str | None:
        if self.lost_device:
            return "the device's CUDA context is unusable (a sticky CUDA error)"
        if self.healthy:
            return None
        return f"{self.consecutive_failures} consecutive batches failed ({self.last_error})"
