"""Attribution with injected values: each cause ranked first when its evidence is there
(and with the evidence the report quotes), phases ranked after the root causes whose time
they contain, and every cause documented in docs/SPIKES.md. The recorder (thresholds,
the ring buffer, the counter, the log line) and the `steadyserve spikes` table are in
test_slow_request_recorder.py."""

from __future__ import annotations

from app.engine.protocol import EngineTrace
from app.spikes.attribution import CAUSES, RequestFacts, attribute
from tests.support.request_facts import FRONT, batch, facts


def top(request: RequestFacts) -> tuple[str, float, str]:
    cause = attribute(request)[0]
    return cause.name, round(cause.seconds * 1000), cause.evidence


def test_gc_pause_in_the_engine() -> None:
    name, ms, evidence = top(
        facts(
            total_s=0.1,  # a pause can delay a request by no more than its time
            engine_probes={
                "gc_gen2_pause_seconds_total": 0.08,
                "gc_gen2_collections_total": 1,
                "loop_lag_seconds_total": 0.08,
                "loop_busy_lag_seconds_total": 0.08,
            },
        )
    )
    assert (name, ms) == ("gc_pause", 80)
    assert evidence == "GC gen-2 pause 80 ms in the engine (1 collection)"


def test_an_engine_collection_in_the_batch_is_not_also_slow_compute_nor_the_front_ends() -> None:
    """A 200 ms collection in the engine, inside its batch, was also reported as 200 ms of
    slow compute, and subtracted from the front end's own time outside the phases: a
    100 ms slow body upload disappeared from the report."""
    phases = {"tokenize": 0.0002, "admission": 0.0, "queue": 0.001, "compute": 0.22}
    request = facts(
        total_s=sum(phases.values()) + 0.1,  # the body took 100 ms to arrive
        phases=phases,
        engine_probes={"gc_gen2_pause_seconds_total": 0.2, "gc_gen2_collections_total": 1},
    )
    causes = {cause.name: round(cause.seconds * 1000) for cause in attribute(request)}
    assert causes["gc_pause"] == 200
    assert causes.get("slow_compute", 0) == 0  # causes of no time are left out
    assert causes["unaccounted"] == 100


def test_loop_lag_from_a_collection_is_not_also_a_blocked_loop() -> None:
    causes = attribute(
        facts(
            front={
                "gc_gen2_pause_seconds_total": 0.1,
                "loop_lag_seconds_total": 0.1,
                "loop_busy_lag_seconds_total": 0.1,
            }
        )
    )
    assert "event_loop_blocked" not in [c.name for c in causes]


def test_blocked_loop() -> None:
    name, ms, evidence = top(
        facts(
            total_s=0.32,
            front={"loop_lag_seconds_total": 0.3, "loop_busy_lag_seconds_total": 0.29},
        )
    )
    assert (name, ms) == ("event_loop_blocked", 290)
    assert "front end's event loop was blocked 290 ms" in evidence


def test_cpu_contention_with_other_processes_cores() -> None:
    name, ms, evidence = top(
        facts(
            total_s=0.2,
            phases={"queue": 0.0, "compute": 0.15},
            trace=batch(run_s=0.148, runqueue_wait_s=0.1),
            front={"host_cpu_busy_seconds_total": 0.25, "process_cpu_seconds_total": 0.05},
        )
    )
    assert (name, ms) == ("cpu_contention", 100)
    assert "compute thread waited 100 ms for a CPU" in evidence
    assert "other processes took 1.0 cores" in evidence


def test_cgroup_throttling() -> None:
    name, ms, evidence = top(
        facts(
            phases={"compute": 0.06},
            engine_probes={
                "cgroup_throttled_seconds_total": 0.042,
                "cgroup_throttled_periods_total": 3,
            },
        )
    )
    assert (name, ms) == ("cgroup_throttled", 42)
    assert evidence == "cgroup throttled 42 ms in 3 CFS periods during this request"


def test_cgroup_throttling_is_wall_time_not_the_sum_over_the_quotas_cpus() -> None:
    """A 20 ms throttle of a 4-CPU quota: the kernel counts 80 ms (each CPU's share), which
    outranked this request's 60 ms garbage collection."""
    throttled = {
        "cgroup_throttled_seconds_total": 0.080,
        "cgroup_throttled_periods_total": 1,
        "cgroup_quota_cpus": 3.5,
    }
    gc = {"gc_gen2_pause_seconds_total": 0.060, "gc_gen2_collections_total": 1}
    assert top(facts(phases={"compute": 0.06}, engine_probes={**throttled, **gc}))[0] == "gc_pause"
    alone = facts(phases={"compute": 0.06}, engine_probes=throttled)
    causes = {cause.name: cause for cause in attribute(alone)}
    assert round(causes["cgroup_throttled"].seconds * 1000) == 20
    assert "(80 ms of CPU time over 4 CPUs)" in causes["cgroup_throttled"].evidence


def test_queueing_behind_inputs() -> None:
    name, ms, evidence = top(facts(phases={"queue": 0.302, "compute": 0.02}, depth=900))
    assert (name, ms) == ("queueing", 300)
    assert evidence == "queued 300 ms behind 900 inputs of its model"


def test_buffer_wait() -> None:
    """The wait for a buffer slot falls between the queue and compute phases, in the gap
    outside them: it is buffer_wait, not also unaccounted (which outranked it)."""
    phases = {"tokenize": 0.0002, "admission": 0.0, "queue": 0.001, "compute": 0.02}
    request = facts(
        total_s=sum(phases.values()) + 0.03 + 0.003,  # the wait, and 3 ms of HTTP and hops
        phases=phases,
        trace=batch(acquire_wait_s=0.03),
    )
    name, ms, evidence = top(request)
    assert (name, ms) == ("buffer_wait", 30)
    assert evidence == "waited 30 ms for a buffer slot of shape (4, 64)"
    causes = {cause.name: round(cause.seconds * 1000) for cause in attribute(request)}
    assert causes["unaccounted"] == 3


def test_unwarmed_shape_without_an_estimate_is_all_set_up() -> None:
    name, ms, evidence = top(
        facts(
            phases={"compute": 0.12},
            trace=batch(padded_rows=64, length_bucket=384, expected_compute_s=0.0,
                        first_seen_shape=True),
        )
    )  # fmt: skip
    assert (name, ms) == ("unwarmed_shape", 120)
    assert evidence.startswith("shape (64, 384) was not warmed up")


def test_gpu_throttling_names_the_clock_and_the_reason() -> None:
    name, ms, evidence = top(
        facts(
            phases={"compute": 0.1},
            engine_probes={
                "gpu_sm_clock_hertz": 810e6,
                "gpu_sm_clock_max_hertz": 1980e6,
                "gpu_throttle_reasons": 0x20,
            },
        )
    )
    assert (name, ms) == ("gpu_throttled", 80)
    assert evidence == "GPU SM clock 810 MHz of 1980, software thermal"


def test_idle_bit_is_not_throttling() -> None:
    causes = attribute(facts(engine_probes={"gpu_throttle_reasons": 0x1}))
    assert "gpu_throttled" not in [c.name for c in causes]


def test_allocator_retry_explains_the_excess_compute() -> None:
    name, ms, evidence = top(
        facts(phases={"compute": 0.07}, engine_probes={"cuda_alloc_retries_total": 3})
    )
    assert (name, ms) == ("allocator_retry", 50)
    assert evidence.startswith("allocator retried 3 times")


def test_slow_compute_without_an_explanation() -> None:
    name, ms, evidence = top(facts(phases={"compute": 0.09}))
    assert (name, ms) == ("slow_compute", 70)
    assert evidence.startswith("batch (4, 64) computed in 90 ms, 20 ms expected")


def test_a_root_cause_outranks_the_phase_its_time_was_spent_in() -> None:
    # A 200 ms collection while the batch ran: the compute phase is 205 ms, the GC's 200.
    # In-process (one process: its collection stops the compute thread too); a front end's
    # own process's collection cannot delay the engine's compute (test_attribution_sides).
    causes = attribute(
        facts(
            phases={"compute": 0.205},
            front={"gc_gen2_pause_seconds_total": 0.2, "gc_gen2_collections_total": 1},
            engine_pid=FRONT,
        )
    )
    assert causes[0].name == "gc_pause"


def test_in_process_engine_probes_are_not_counted_twice() -> None:
    shared = {"gc_gen0_pause_seconds_total": 0.05, "gc_gen0_collections_total": 2}
    request = RequestFacts(
        total_s=0.2,
        phases={"compute": 0.02},
        frontend_pid=FRONT,
        frontend_probes=shared,
        engine=EngineTrace(FRONT, 0, batch(), shared),
    )
    gc_cause = next(c for c in attribute(request) if c.name == "gc_pause")
    assert round(gc_cause.seconds, 3) == 0.05


def test_every_cause_is_documented() -> None:
    from tests.support.server import REPO_ROOT

    spikes = (REPO_ROOT / "docs" / "SPIKES.md").read_text()
    missing = [name for name in CAUSES if f"`{name}`" not in spikes]
    assert not missing, missing


def test_compute_is_a_cause_when_the_engine_sent_no_trace() -> None:
    # The engine traces only requests slow there: a request made slow in the front end
    # lost its compute phase, its largest, from every cause.
    request = RequestFacts(
        total_s=0.16,
        phases={"tokenize": 0.02, "queue": 0.004, "compute": 0.07},
        frontend_pid=FRONT,
        frontend_probes={"gc_gen2_pause_seconds_total": 0.03, "gc_gen2_collections_total": 1},
        engine=None,
        batching_window_s=0.002,
    )
    causes = {cause.name: round(cause.seconds * 1000) for cause in attribute(request)}
    assert causes["compute"] == 70


def test_unaccounted_time_is_not_discounted_by_a_front_end_pause_twice() -> None:
    # 300 ms: 50 queued, a 100 ms front-end collection, 150 outside every phase. The
    # collection was already taken out of `unaccounted`; discounting it again ranked the
    # 100 ms collection above the 150 ms.
    request = facts(
        total_s=0.3,
        phases={"queue": 0.05},
        front={"gc_gen2_pause_seconds_total": 0.1, "gc_gen2_collections_total": 1},
        trace=batch(run_s=0.0, copy_in_s=0.0, copy_out_s=0.0, expected_compute_s=0.0),
    )
    causes = attribute(request)
    assert [(c.name, round(c.seconds * 1000)) for c in causes[:2]] == [
        ("unaccounted", 150),
        ("gc_pause", 100),
    ]


def test_a_request_the_engine_went_away_with_names_the_engine() -> None:
    # Its 503 came after a wait no phase held: all of it was "unaccounted".
    request = RequestFacts(
        total_s=0.5,
        phases={"tokenize": 0.001, "admission": 0.0, "engine_lost": 0.49},
        frontend_pid=FRONT,
        frontend_probes={},
        engine=None,
        batching_window_s=0.002,
    )
    name, ms, evidence = top(request)
    assert (name, ms) == ("engine_lost", 490)
    assert evidence.startswith("the engine went away with the request in it, 490 ms after")


def test_a_row_answered_after_its_batch_failed_names_the_failed_batch() -> None:
    """Its time in the failed batch read as queue wait (or, as compute, as the model being
    slow at its own run): the failed batch is the cause."""
    request = facts(
        phases={"queue": 0.001, "compute": 0.22},
        trace=batch(expected_compute_s=0.01, failed_batch_s=0.21),
    )
    name, ms, evidence = top(request)
    assert (name, ms) == ("failed_batch", 210)
    assert "its batch of 4 rows at (4, 64) failed" in evidence
    names = {cause.name for cause in attribute(request)}
    assert "slow_compute" not in names and "queueing" not in names
