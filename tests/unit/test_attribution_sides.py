"""Attribution over constructed timelines: a process's loss counts only where it could have
delayed the request (a front end's pause while the engine computed delayed it not at all),
and a phase counts what the root causes on its side of the request leave of it."""

from __future__ import annotations

from dataclasses import replace

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
    assert (
        "only 6.0 ms of the front end's could delay it, outside its 194 ms in the engine"
        in gc.evidence
    )


def test_the_requests_own_work_on_the_loop_is_its_phase_not_a_blocked_loop() -> None:
    """Rendering a 120 ms answer made the front end's 10 ms ticker 120 ms late: reported as
    the event loop blocked 120 ms, ranked above `serialise` (the remedy is base64, not
    moving a blocking call off the loop)."""
    phases = {"tokenize": 0.001, "admission": 0.0, "queue": 0.002, "compute": 0.02}
    causes = attribute(
        request(
            total_s=0.15,
            phases={**phases, "serialise": 0.12},
            front={"loop_lag_seconds_total": 0.121, "loop_busy_lag_seconds_total": 0.12},
            batch=estimated_batch(0.02),
        )
    )
    assert causes[0].name == "serialise"
    assert "event_loop_blocked" not in times(causes)


def test_other_work_blocking_the_loop_is_counted_beyond_the_requests_own() -> None:
    # 50 ms rendering its own answer, and 30 ms of another request's blocking call while
    # this one waited on the loop: the ticker was 80 ms late.
    causes = attribute(
        request(
            total_s=0.15,
            phases={"queue": 0.002, "compute": 0.02, "serialise": 0.05},
            front={"loop_lag_seconds_total": 0.08, "loop_busy_lag_seconds_total": 0.08},
            batch=estimated_batch(0.02),
        )
    )
    blocked = next(cause for cause in causes if cause.name == "event_loop_blocked")
    assert round(blocked.seconds * 1000) == 30
    assert blocked.evidence == (
        "the front end's event loop was blocked 30 ms (beyond this request's own 50 ms on it)"
    )


def test_a_loop_blocked_while_the_request_tokenized_on_the_pool_is_other_work() -> None:
    """A 40,000-character input tokenized on the tokenizer pool for 100 ms while another
    request's blocking call held the loop 100 ms: the loop's lateness was not this
    request's own work (its tokenizing left the loop free), so the blocked loop is a cause.
    Counted as the request's own, it was taken off and the block went unreported."""
    phases = {"tokenize": 0.1, "admission": 0.0, "queue": 0.002, "compute": 0.02}
    facts = request(
        total_s=0.15,
        phases={**phases, "serialise": 0.001},
        front={"loop_lag_seconds_total": 0.1, "loop_busy_lag_seconds_total": 0.1},
        batch=estimated_batch(0.02),
    )
    blocked = times(attribute(replace(facts, off_loop=frozenset({"tokenize"}))))
    assert blocked.get("event_loop_blocked", 0) >= 99, blocked
    # Tokenized inline, the same lateness is the request's own tokenizing.
    assert "event_loop_blocked" not in times(attribute(facts))


def test_parsing_a_large_body_on_the_loop_is_its_own_phase_not_a_blocked_loop() -> None:
    """A 20 MB body decoded and validated in 120 ms on the front end's loop made its 10 ms
    ticker 120 ms late; the rest was 25 ms of the request's other phases. With parsing
    untimed that read as the event loop blocked 120 ms by other work (the remedy for which,
    moving a blocking call off the loop, is not this one's: a smaller body is)."""
    phases = {"tokenize": 0.001, "admission": 0.0, "queue": 0.002, "compute": 0.02}
    causes = attribute(
        request(
            total_s=0.15,
            phases={"parse_body": 0.12, **phases, "serialise": 0.001},
            front={"loop_lag_seconds_total": 0.12, "loop_busy_lag_seconds_total": 0.12},
            batch=estimated_batch(0.02),
        )
    )
    assert (causes[0].name, round(causes[0].seconds * 1000)) == ("parse_body", 120)
    assert causes[0].evidence == "parsing the request's body (JSON, validation) took 120 ms"
    assert "event_loop_blocked" not in times(causes)
    assert times(causes).get("unaccounted", 0) <= 6


def test_an_engine_pause_while_the_front_end_parsed_the_body_delayed_nothing() -> None:
    """The engine process collected for 100 ms while the front end was still parsing the
    request's body (120 ms): the request had not reached the engine, so at most its 30 ms
    outside the front end's phases could have been that collection's."""
    causes = attribute(
        request(
            total_s=0.15,
            phases={"parse_body": 0.12, "queue": 0.002, "compute": 0.02},
            engine={
                "gc_gen2_pause_seconds_total": 0.1,
                "gc_gen2_collections_total": 1,
                "loop_lag_seconds_total": 0.1,
                "loop_busy_lag_seconds_total": 0.1,
            },
            batch=estimated_batch(0.02),
        )
    )
    assert causes[0].name == "parse_body"
    assert times(causes)["gc_pause"] <= 30


def test_an_engine_stall_after_compute_is_its_root_cause_not_also_unaccounted() -> None:
    """Tokenize 1 ms, queue 5, compute 20 (at its estimate); then a 150 ms collection in the
    engine before it sent the answer (outside every phase), and 24 ms of hops: 200 ms. The
    stall was counted as gc_pause and again as unaccounted (174 ms, ranked first)."""
    causes = attribute(
        request(
            total_s=0.2,
            phases={"tokenize": 0.001, "admission": 0.0, "queue": 0.005, "compute": 0.02},
            engine={
                "gc_gen2_pause_seconds_total": 0.15,
                "gc_gen2_collections_total": 1,
                "loop_lag_seconds_total": 0.15,
                "loop_busy_lag_seconds_total": 0.15,
            },
            batch=estimated_batch(0.02),
        )
    )
    assert [(cause.name, round(cause.seconds * 1000)) for cause in causes[:2]] == [
        ("gc_pause", 150),
        ("unaccounted", 24),
    ]
    assert sum(cause.seconds for cause in causes) <= 0.2


TIMELINES = [
    # (total, phases, front probes, engine probes, batch)
    (  # a front-end collection during compute
        0.2,
        {"tokenize": 0.001, "queue": 0.004, "compute": 0.19},
        {"gc_gen2_pause_seconds_total": 0.18},
        {},
        estimated_batch(0.19),
    ),
    (  # an engine stall after compute, and its loop blocked besides
        0.2,
        {"tokenize": 0.001, "queue": 0.005, "compute": 0.02},
        {},
        {"gc_gen2_pause_seconds_total": 0.15, "loop_busy_lag_seconds_total": 0.19},
        estimated_batch(0.02),
    ),
    (  # both processes collecting in the gap, and the front end's loop starved
        0.3,
        {"queue": 0.01, "compute": 0.02},
        {"gc_gen1_pause_seconds_total": 0.12, "loop_lag_seconds_total": 0.25},
        {"gc_gen2_pause_seconds_total": 0.2},
        estimated_batch(0.02),
    ),
    (  # every device cause explaining the same excess, and throttling over all of it
        0.12,
        {"queue": 0.001, "compute": 0.11},
        {"cgroup_throttled_seconds_total": 0.5, "cgroup_throttled_periods_total": 9},
        {
            "gpu_throttle_reasons": 0x20,
            "gpu_sm_clock_hertz": 500e6,
            "gpu_sm_clock_max_hertz": 2000e6,
            "cuda_alloc_retries_total": 2,
            "cuda_context_changes_total": 1,
        },
        estimated_batch(0.01, first_seen_shape=True, runqueue_wait_s=0.05),
    ),
    (  # pauses longer than the request, a buffer wait, a long parse and a long render
        0.1,
        {"parse_body": 0.02, "tokenize": 0.01, "queue": 0.03, "compute": 0.01, "serialise": 0.04},
        {"gc_gen0_pause_seconds_total": 0.3, "loop_busy_lag_seconds_total": 0.4},
        {"gc_gen2_pause_seconds_total": 0.3, "loop_lag_seconds_total": 0.5},
        estimated_batch(0.01, acquire_wait_s=0.02, failed_batch_s=0.01),
    ),
]


def test_causes_never_explain_more_than_the_requests_time() -> None:
    for total_s, phases, front, engine, batch in TIMELINES:
        for traced in (True, False):
            facts = request(total_s, phases, front, engine, batch)
            if not traced:
                facts = RequestFacts(total_s, phases, FRONT, front, None, 0.002)
            causes = attribute(facts)
            assert sum(cause.seconds for cause in causes) <= total_s + 1e-9, times(causes)


def test_queueing_without_the_engines_trace_does_not_claim_an_empty_queue() -> None:
    # It said "queued 175 ms behind 0 inputs": the engine sent no trace, the depth is unknown.
    facts = RequestFacts(0.2, {"queue": 0.175, "compute": 0.02}, FRONT, {}, None, 0.0)
    queueing = next(cause for cause in attribute(facts) if cause.name == "queueing")
    assert queueing.evidence == (
        "queued 175 ms (the engine sent no trace: the queue's depth is unknown)"
    )


def test_queueing_behind_another_models_batch_says_the_compute_slots_were_busy() -> None:
    trace = EngineTrace(ENGINE, 0, estimated_batch(0.02), {}, busy_compute_slots_at_arrival=1,
                        compute_slots=1)  # fmt: skip
    facts = RequestFacts(0.2, {"queue": 0.175, "compute": 0.02}, FRONT, {}, trace, 0.0)
    queueing = next(cause for cause in attribute(facts) if cause.name == "queueing")
    assert queueing.evidence == (
        "queued 175 ms behind 0 inputs of its model; 1 of the 1 compute slots shared by "
        "every model were running a batch when it arrived"
    )


def test_in_process_a_blocked_loop_during_compute_is_the_cause_not_slow_compute() -> None:
    """In-process (one process, one loop) a call blocking the loop for 250 ms while the
    batch ran stops the compute thread too (the GIL): the batch's excess is the blocked
    loop's, not unexplained slow compute (tests/integration/test_spikes.py causes it)."""
    phases = {"tokenize": 0.0003, "admission": 0.0, "queue": 0.001, "compute": 0.262}
    facts = RequestFacts(
        total_s=0.268,
        phases={**phases, "serialise": 0.0004},
        frontend_pid=FRONT,
        frontend_probes={"loop_lag_seconds_total": 0.246, "loop_busy_lag_seconds_total": 0.245},
        engine=EngineTrace(FRONT, 0, estimated_batch(0.012), {}),
        batching_window_s=0.002,
    )
    causes = attribute(facts)
    assert causes[0].name == "event_loop_blocked"
    assert times(causes).get("slow_compute", 0) < 10
