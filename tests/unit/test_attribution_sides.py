"""Attribution over constructed timelines: a process's loss counts only where it could have
delayed the request (a front end's pause while the engine computed delayed it not at all),
and a phase counts what the root causes on its side of the request leave of it."""

from __future__ import annotations

from app.engine.protocol import BatchTrace, EngineTrace
from app.spikes.attribution import Cause, RequestFacts, attribute

FRONT, ENGINE = 100, 200


def estimated_batch(expected_s: float, **overrides: object) -> BatchTrace:
    values: dict[str, object] = {
        "rows": 1,
        "padded_rows": 1,
        "length_bucket": 64,
        "co_batched_lengths": [40],
        "acquire_wait_s": 0.0,
        "copy_in_s": 0.0,
        "run_s": expected_s,
        "copy_out_s": 0.0,
        "expected_compute_s": expected_s,
        "runqueue_wait_s": 0.0,
        "first_seen_shape": False,
    }
    return BatchTrace(**{**values, **overrides})  # type: ignore[arg-type]


def request(
    total_s: float,
    phases: dict[str, float],
    front: dict[str, float] | None = None,
    engine: dict[str, float] | None = None,
    batch: BatchTrace | None = None,
) -> RequestFacts:
    """A request to an engine in its own process that sent its trace."""
    return RequestFacts(
        total_s=total_s,
        phases=phases,
        frontend_pid=FRONT,
        frontend_probes=front or {},
        engine=EngineTrace(ENGINE, 0, batch, engine or {}),
        batching_window_s=0.0,
    )


def times(causes: list[Cause]) -> dict[str, float]:
    return {cause.name: round(cause.seconds * 1000, 1) for cause in causes}


def test_a_front_end_pause_while_the_engine_computed_delayed_nothing() -> None:
    """Tokenize 1 ms, queue 4, compute 190 (at its estimate); a 180 ms collection in the
    front end during that compute, over before the answer came back: 200 ms in all. It was
    reported first (180 ms) and compute as 10."""
    causes = attribute(
        request(
            total_s=0.2,
            phases={"tokenize": 0.001, "admission": 0.0, "queue": 0.004, "compute": 0.19},
            front={"gc_gen2_pause_seconds_total": 0.18, "gc_gen2_collections_total": 1},
            batch=estimated_batch(0.19),
        )
    )
    assert causes[0].name == "compute"
    found = times(causes)
    assert found["compute"] == 190
    # At most its 6 ms outside the engine's phases could have been the collection's.
    assert found["gc_pause"] <= 6
    gc = next(cause for cause in causes if cause.name == "gc_pause")
    assert "GC gen-2 pause 180 ms in the front end" in gc.evidence
    assert "the rest fell in its 194 ms in the engine" in gc.evidence
