"""Probes whose readings are slow to take, sampled off the event loop.

A driver call (NVML: microseconds to milliseconds each, more on a GPU in trouble) or a walk
of the CUDA allocator's blocks (a dict per block, built under the GIL) costs more than a
probe read on the loop may (`probe.py`: reads must be cheap; only the dispatcher blocks).
A `BackgroundProbe` takes its reading in `sample()`, on its process's sampler thread
(`steadyserve-probe-sampler`), every `sample_every_s`; `read()`, on the loop, returns the
latest sample, published by replacing one reference (atomic under the GIL), so the loop
never waits for a driver. `ProbeSampler` is that thread: one per process, started, stopped
and joined with its `ProcessTelemetry`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

log = logging.getLogger(__name__)

SAMPLER_THREAD_NAME = "steadyserve-probe-sampler"

# How long a stopping process waits for the sampler's sample in progress: NVML answers in
# micro- to milliseconds, but a driver call on a failing GPU can hang far longer, and the
# process must still exit, the engine within its stop budget (`drain.ENGINE_STOP_S`, which
# its batches' end and the dispatcher's shutdown share).
SAMPLER_JOIN_TIMEOUT_S = 1.0


class BackgroundProbe:
    """Subclasses set `sample_every_s` and implement `sample()`."""

    sample_every_s: float = 0.05

    def __init__(self) -> None:
        self._latest: Mapping[str, float] = {}

    def sample(self) -> Mapping[str, float]:
        """Take a reading now (slow). Sampler thread only (or a test driving it)."""
        raise NotImplementedError

    def publish(self, readings: Mapping[str, float]) -> None:
        """Make `readings` what `read()` returns. Sampler thread only."""
        self._latest = dict(readings)

    def read(self) -> Mapping[str, float]:
        """The latest published sample (empty before the first). Any thread; never blocks."""
        return self._latest


class ProbeSampler:
    """Samples each background probe when it is due, on a daemon thread of its own."""

    def __init__(
        self, probes: Iterable[BackgroundProbe], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.probes = list(probes)
        self._clock = clock
        self._due = [0.0] * len(self.probes)
        self._failing: set[int] = set()  # probes whose last sample raised (logged once)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.join_timeout_s = SAMPLER_JOIN_TIMEOUT_S
        # Called on the sampler thread after each round (tests wait on it).
        self.on_round: Callable[[], None] = lambda: None

    def run_due(self, now: float) -> float:
        """Sample and publish every probe due at `now`; returns when the next one is due.
        Sampler thread only (or a test driving it)."""
        for i, probe in enumerate(self.probes):
            if now < self._due[i]:
                continue
            self._due[i] = now + probe.sample_every_s
            try:
                readings = probe.sample()
            except Exception as error:  # a probe's bug must not end the others' sampling
                if i not in self._failing:
                    log.warning("%s failed (%r): it reads nothing", type(probe).__name__, error)
                    self._failing.add(i)
                readings = {}
            else:
                self._failing.discard(i)
            probe.publish(readings)
        self.on_round()
        return min(self._due)

    @property
    def running(self) -> bool:
        """Whether its thread is alive (started, and not yet ended). Any thread."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread (none when there is no background probe). Loop thread only."""
        if not self.probes or self._thread is not None:
            return
        # A daemon, so that a sample hanging in the driver past `join`'s timeout does not
        # hold up the process's exit; `join` makes sure that is the only case left running.
        self._thread = threading.Thread(target=self._run, name=SAMPLER_THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end after its current sample; `join` waits for that. Loop
        thread only."""
        self._stop.set()

    def join(self) -> bool:
        """Wait up to `join_timeout_s` for a stopped thread to end; whether it has (True if
        none was started). One still sampling then is logged and left: it is inside a
        driver call that hangs. Blocks: not on an event loop (`ProcessTelemetry.stop`
        calls it on a worker thread)."""
        if self._thread is None:
            return True
        self._thread.join(self.join_timeout_s)
        if self._thread.is_alive():
            log.warning(
                "the probe sampler is still sampling %g s after it was stopped (a driver "
                "call hanging?): left running",
                self.join_timeout_s,
            )
            return False
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            next_due = self.run_due(self._clock())
            self._stop.wait(max(0.0, next_due - self._clock()))
