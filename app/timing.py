"""Per-request phase durations, rendered as a `Server-Timing` header."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.engine.protocol import EngineTrace


@dataclass(slots=True)
class PhaseTimer:
    """Durations of a request's phases, rendered as a `Server-Timing` header.

    Mutable by design: one request's phases accumulate in it as they happen.
    """

    started: float = field(default_factory=time.perf_counter)
    phases: dict[str, float] = field(default_factory=dict)
    # The engine's side of the request (batch, probes), for a slow-request report.
    engine_trace: EngineTrace | None = None
    # False where the request's time is its client's doing, so it is never judged slow (nor
    # counted in the p99 that judgement uses): a generation (as long as the tokens asked
    # for), a body refused for arriving too slowly or too large (the app's answer to it is
    # not even what the client got).
    latency_bound: bool = True
    # Phases that ran off the event loop (a large input tokenized on the tokenizer pool):
    # the loop was free meanwhile, so its lateness then was not this request's own work.
    off_loop: set[str] = field(default_factory=set)

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def header(self) -> str:
        entries = [f"{name};dur={seconds * 1000:.2f}" for name, seconds in self.phases.items()]
        entries.append(f"total;dur={(time.perf_counter() - self.started) * 1000:.2f}")
        return ", ".join(entries)
