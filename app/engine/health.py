"""Pure run-time health: an engine whose batches keep failing is unhealthy.

Start-up failures are reported separately; this watches the batches afterwards (a device
lost, a driver fault, a model that throws on every input). After `threshold` consecutive
failed batches the engine reports unhealthy, /healthz answers 503 and Kubernetes restarts
the pod; a single successful batch clears it. Engine event loop thread only.
"""

from __future__ import annotations


class BatchHealth:
    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.consecutive_failures = 0
        self.last_error: str | None = None

    def record(self, error: BaseException | None) -> None:
        """Called once per finished batch, with its exception if it failed."""
        if error is None:
            self.consecutive_failures = 0
            self.last_error = None
            return
        self.consecutive_failures += 1
        self.last_error = type(error).__name__

    @property
    def healthy(self) -> bool:
        return self.consecutive_failures < self.threshold

    @property
    def problem(self) -> str | None:
        if self.healthy:
            return None
        return f"{self.consecutive_failures} consecutive batches failed ({self.last_error})"
