"""A slow request's facts for attribution and the recorder, built from injected values:
`facts` (phases, the front end's and the engine's probes, the batch's trace) with
`batch` a typical batch's trace, each overridable; the front end's pid is FRONT, the
engine's ENGINE (the same pid means in-process)."""

from __future__ import annotations

from app.engine.protocol import BatchTrace, EngineTrace
from app.spikes.attribution import RequestFacts

FRONT, ENGINE = 100, 200


def batch(**overrides: object) -> BatchTrace:
    values: dict[str, object] = {
        "rows": 4,
        "padded_rows": 4,
        "length_bucket": 64,
        "co_batched_lengths": [10, 20, 30, 64],
        "acquire_wait_s": 0.0,
        "copy_in_s": 0.001,
        "run_s": 0.018,
        "copy_out_s": 0.001,
        "expected_compute_s": 0.02,
        "runqueue_wait_s": 0.0,
        "first_seen_shape": False,
    }
    return BatchTrace(**{**values, **overrides})  # type: ignore[arg-type]


def facts(
    total_s: float | None = None,
    phases: dict[str, float] | None = None,
    front: dict[str, float] | None = None,
    engine_probes: dict[str, float] | None = None,
    trace: BatchTrace | None = None,
    depth: int = 0,
    engine_pid: int = ENGINE,
) -> RequestFacts:
    phases = phases or {"tokenize": 0.0002, "admission": 0.0, "queue": 0.001, "compute": 0.02}
    return RequestFacts(
        # Unless given: the phases and 1 ms outside them (HTTP, the hop to the engine).
        total_s=total_s if total_s is not None else sum(phases.values()) + 0.001,
        phases=phases,
        frontend_pid=FRONT,
        frontend_probes=front or {},
        engine=EngineTrace(engine_pid, depth, trace or batch(), engine_probes or {}),
        batching_window_s=0.002,
    )
