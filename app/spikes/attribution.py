"""Why a request was slow: its causes, each with the time it explains and its evidence,
most time first. Pure: it reads a request's facts (phases, the engine's trace, each
process's probe changes) and nothing else, so tests feed it values by hand.

Causes and how each is detected are listed in docs/SPIKES.md (kept in step with `CAUSES`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from app.engine.protocol import EngineTrace
from app.spikes.losses import (
    ENGINE_PHASES,
    FRONT_END_PHASES,
    ProcessLoss,
    cgroup_throttling,
    phases_sum,
    process_loss,
)
from app.telemetry.gpu import SLOWDOWN_BITS, throttle_reason_names

# Every cause, in the order ties are broken (the more specific first).
CAUSES = (
    "gc_pause",
    "event_loop_blocked",
    "cpu_contention",
    "cgroup_throttled",
    "gpu_throttled",
    "allocator_retry",
    "cuda_context_change",
    "unwarmed_shape",
    "failed_batch",
    "engine_lost",
    "buffer_wait",
    "queueing",
    "admission_wait",
    "slow_compute",
    "compute",
    "parse_body",
    "tokenize",
    "serialise",
    "unaccounted",
)
# Root causes: something happened to the request. The others say in which phase its time
# went, and a root cause's time is spent inside some phase: so a phase counts what is left
# of it once the root causes on its side of the request are taken off (`attribute`).
ROOT_CAUSES = frozenset(CAUSES[: CAUSES.index("buffer_wait")])
# The phases of the request's own work on the front end's event loop (which made its loop
# late too: not a blocked loop), and what each was, as its evidence says it.
_LOOP_WORK = {
    "parse_body": "parsing the request's body (JSON, validation)",
    "tokenize": "tokenizing",
    "serialise": "rendering the answer",
}
# Causes explaining less than this are left out of a report.
MIN_CAUSE_S = 0.0005


@dataclass(frozen=True, slots=True)
class Cause:
    name: str
    seconds: float
    evidence: str

    def as_dict(self) -> dict[str, object]:
        return {"cause": self.name, "ms": round(self.seconds * 1000, 2), "evidence": self.evidence}


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """`phases`: the front end's phase seconds (parse_body, tokenize, admission, queue,
    compute, serialise, engine_lost); `off_loop`: those of them that ran off the front end's
    event loop (`PhaseTimer.off_loop`); `frontend_probes`: the front end's probe changes
    over the request; `batching_window_s`: queueing the batch policy intends (max wait), not
    counted as a cause."""

    total_s: float
    phases: Mapping[str, float]
    frontend_pid: int
    frontend_probes: Mapping[str, float] = field(default_factory=dict)
    engine: EngineTrace | None = None
    batching_window_s: float = 0.0
    off_loop: frozenset[str] = frozenset()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.0095 else f"{seconds * 1000:.1f} ms"


def _device_probes(facts: RequestFacts) -> Mapping[str, float]:
    return facts.engine.probes if facts.engine is not None else {}


def _gc_evidence(
    where: str, probes: Mapping[str, float], loss: ProcessLoss, span: str
) -> list[str]:
    evidence = []
    for generation in (2, 1, 0):
        pause = probes.get(f"gc_gen{generation}_pause_seconds_total", 0.0)
        count = int(probes.get(f"gc_gen{generation}_collections_total", 0.0))
        if pause > 0:
            plural = "s" if count != 1 else ""
            collections = f"{count} collection{plural}"
            evidence.append(
                f"GC gen-{generation} pause {_ms(pause)} in the {where} ({collections})"
            )
    if loss.gc_measured - loss.gc >= MIN_CAUSE_S:
        evidence.append(f"only {_ms(loss.gc)} of the {where}'s could delay it, {span}")
    return evidence


def attribute(facts: RequestFacts) -> list[Cause]:
    """The causes of a request's time, most first (ties: the more specific first). A root
    cause counts the time it could have delayed the request; a phase what the root causes
    on its side of the request (the front end's, the engine's) leave of it."""
    causes: list[Cause] = []
    phases, total = facts.phases, facts.total_s

    # --- the processes: GC, the event loop, the CPU -------------------------------------
    # In-process the engine's loss is the front end's (one process, one loop); else each
    # process's loss counts only within the request's time on its side.
    shared = facts.engine is not None and facts.engine.pid == facts.frontend_pid
    in_engine = phases_sum(phases, ENGINE_PHASES)
    # The request's own work on the front end's loop: parsing its body, rendering its
    # answer, tokenizing a small input inline. A large input's tokenizing on the pool left
    # the loop free: lateness meanwhile was other work's.
    on_loop = phases_sum(phases, tuple(p for p in _LOOP_WORK if p not in facts.off_loop))
    front_window = total if shared else max(0.0, total - in_engine)
    front = process_loss(facts.frontend_probes, front_window, on_loop)
    processes = [("front end", facts.frontend_probes, front, f"{_ms(in_engine)} in the engine")]
    engine = front if shared else ProcessLoss()
    if facts.engine is not None and not shared:
        in_front = phases_sum(phases, FRONT_END_PHASES)
        engine = process_loss(facts.engine.probes, max(0.0, total - in_front))
        span = f"{_ms(in_front)} in the front end's phases"
        processes.append(("engine", facts.engine.probes, engine, span))

    gc_evidence = [
        line
        for where, probes, loss, away in processes
        for line in _gc_evidence(where, probes, loss, f"outside its {away}")
    ]
    causes.append(Cause("gc_pause", sum(p[2].gc for p in processes), "; ".join(gc_evidence)))
    own = f" (beyond this request's own {_ms(on_loop)} on it)" if on_loop >= MIN_CAUSE_S else ""
    blocked_evidence = [
        f"the {where}'s event loop was blocked {_ms(loss.blocked)}" + (own if loss is front else "")
        for where, _, loss, _ in processes
        if loss.blocked > 0
    ]
    blocked_total = sum(p[2].blocked for p in processes)
    causes.append(Cause("event_loop_blocked", blocked_total, "; ".join(blocked_evidence)))

    batch = facts.engine.batch if facts.engine is not None else None
    batch_wall = batch.copy_in_s + batch.run_s + batch.copy_out_s if batch else 0.0
    starved_batch = min(batch.runqueue_wait_s, batch_wall) if batch else 0.0
    starved_loop = max(front.starved, engine.starved)
    evidence = []
    if batch is not None and starved_batch > 0:
        evidence.append(
            f"its compute thread waited {_ms(starved_batch)} for a CPU during its "
            f"{_ms(batch_wall)} batch"
        )
    if starved_loop > 0:
        evidence.append(f"an event loop waited {_ms(starved_loop)} for a CPU")
    own_cpu = sum(p[1].get("process_cpu_seconds_total", 0.0) for p in processes)
    host = facts.frontend_probes.get("host_cpu_busy_seconds_total")
    if host is not None and total > 0:
        others = max(0.0, host - own_cpu) / total
        evidence.append(f"other processes took {others:.1f} cores")
    causes.append(Cause("cpu_contention", max(starved_batch, starved_loop), "; ".join(evidence)))
    throttling = cgroup_throttling([p[1] for p in processes], total)
    throttled = throttling.seconds
    over = f" ({_ms(throttling.cpu_seconds)} of CPU time over {throttling.cpus} CPUs)"
    causes.append(
        Cause(
            "cgroup_throttled",
            throttled,
            f"cgroup throttled {_ms(throttled)}{over if throttling.cpus > 1 else ''} in "
            f"{throttling.periods} CFS periods during this request",
        )
    )

    # --- the batch and the device -----------------------------------------------------
    compute = phases.get("compute", 0.0)
    expected = batch.expected_compute_s if batch else 0.0
    excess = max(0.0, compute - expected) if expected > 0 else 0.0
    shape = f"({batch.padded_rows}, {batch.length_bucket})" if batch else "?"
    device = _device_probes(facts)
    # A collection or a blocked loop in the engine's process stops its compute thread too
    # (the GIL it holds), so far as the batch took longer than its estimate (one at its
    # estimate was not slowed). In-process that process is the front end's.
    held = min(engine.gc + engine.blocked, excess)
    explained = max(starved_batch, min(throttled, compute), held)

    bits = int(device.get("gpu_throttle_reasons", 0.0))
    if bits & SLOWDOWN_BITS:
        clock = device.get("gpu_sm_clock_hertz", 0.0)
        top = device.get("gpu_sm_clock_max_hertz", 0.0)
        slowed = compute * (1 - clock / top) if clock and top else 0.0
        seconds = max(excess, slowed)
        explained = max(explained, seconds)
        names = ", ".join(throttle_reason_names(bits & SLOWDOWN_BITS))
        clock_text = f"GPU SM clock {clock / 1e6:.0f} MHz" + (f" of {top / 1e6:.0f}" if top else "")
        causes.append(Cause("gpu_throttled", seconds, f"{clock_text}, {names}"))

    retries = device.get("cuda_alloc_retries_total", 0.0)
    if retries > 0:
        explained = max(explained, excess)
        causes.append(
            Cause(
                "allocator_retry",
                excess,
                f"allocator retried {int(retries)} times (flushed its cache and called "
                f"cudaMalloc again)",
            )
        )
    context_changes = device.get("cuda_context_changes_total", 0.0)
    if context_changes > 0:
        explained = max(explained, excess)
        causes.append(
            Cause(
                "cuda_context_change",
                excess,
                f"a compute thread found a new CUDA context current ({int(context_changes)}x)",
            )
        )
    if batch is not None and batch.first_seen_shape:
        # Nothing was measured at this shape before: all of its time above the estimate (or
        # all of it, without one) is set-up.
        unwarmed = excess if expected > 0 else compute
        explained = max(explained, unwarmed)
        causes.append(
            Cause(
                "unwarmed_shape",
                unwarmed,
                f"shape {shape} was not warmed up: its first batch took {_ms(compute)}",
            )
        )
    if batch is not None and batch.failed_batch_s > 0:
        # In the compute phase, and what its batch's failure cost it: not queue wait, and
        # not the model being slow (`slow_compute`) at the row's own run.
        failed = min(batch.failed_batch_s, compute)
        explained = max(explained, failed)
        causes.append(
            Cause(
                "failed_batch",
                failed,
                f"its batch of {batch.rows} rows at {shape} failed; answered from its own "
                f"run alone, {_ms(failed)} later than its batch would have",
            )
        )

    # --- the phases, less the root causes on their side --------------------------------
    # The root causes inside compute fill its excess first: a batch at its estimate was not
    # slowed (a front end's pause meanwhile, in another process, stopped nothing of it).
    compute_lost = max(0.0, explained - excess)
    # The engine process's stalls that its compute's excess does not hold held up its
    # queue or its answer after compute, outside every phase.
    stalled = max(0.0, engine.total - held)
    engine_side_loss = max(stalled, throttled)
    if batch is not None:
        causes.append(
            Cause(
                "buffer_wait",
                _net(batch.acquire_wait_s, engine_side_loss),
                f"waited {_ms(batch.acquire_wait_s)} for a buffer slot of shape {shape}",
            )
        )
        # What no root cause explains of the excess: a net time already.
        causes.append(
            Cause(
                "slow_compute",
                max(0.0, excess - explained),
                f"batch {shape} computed in {_ms(compute)}, {_ms(expected)} expected "
                f"(copy in {_ms(batch.copy_in_s)}, run {_ms(batch.run_s)}, copy out "
                f"{_ms(batch.copy_out_s)})",
            )
        )
        if not batch.first_seen_shape or expected > 0:
            causes.append(
                Cause(
                    "compute",
                    _net(min(compute, expected) if expected > 0 else compute, compute_lost),
                    f"the model's own time for {batch.rows} inputs at {shape}, batched with "
                    f"lengths {batch.co_batched_lengths}",
                )
            )

    if batch is None and compute > 0:
        # The engine traces only a request slow at the engine (over half the threshold);
        # the time it computed is still the request's, and no other cause holds it.
        causes.append(
            Cause(
                "compute",
                _net(compute, compute_lost),
                f"computed {_ms(compute)} (the engine sent no trace)",
            )
        )

    lost = phases.get("engine_lost", 0.0)
    causes.append(
        Cause(
            "engine_lost",
            _net(lost, engine_side_loss),
            f"the engine went away with the request in it, {_ms(lost)} after it was sent "
            f"(it died, or answered nothing past the deadline)",
        )
    )

    queue = max(0.0, phases.get("queue", 0.0) - facts.batching_window_s)
    causes.append(Cause("queueing", _net(queue, engine_side_loss), _queued(facts, queue)))
    front_side_loss = max(front.largest, throttled)
    admission = phases.get("admission", 0.0)
    causes.append(
        Cause(
            "admission_wait",
            _net(admission, front_side_loss),
            f"waited {_ms(admission)} for admission",
        )
    )
    for phase, work in _LOOP_WORK.items():
        spent = phases.get(phase, 0.0)
        causes.append(Cause(phase, _net(spent, front_side_loss), f"{work} took {_ms(spent)}"))

    # The wait for a buffer slot comes after the queue phase ends and before compute starts:
    # it is in the gap, and already a cause of its own. The gap holds what the processes
    # lost outside the phases too: a front end's loss, an engine's stall after compute
    # (each part counted once, as its root cause).
    buffer_wait = batch.acquire_wait_s if batch is not None else 0.0
    gap = max(0.0, total - sum(phases.values()) - buffer_wait)
    # In-process the engine's stalls are the front end's loss: counted once.
    gap_loss = front.total + (0.0 if shared else stalled)
    unaccounted = _net(gap, max(gap_loss, throttled))
    causes.append(
        Cause(
            "unaccounted",
            unaccounted,
            f"{_ms(gap)} outside the measured phases (receiving the body, routing, the hop "
            f"to and from the engine), {_ms(unaccounted)} of it not explained above",
        )
    )
    return rank(causes, total)


def _queued(facts: RequestFacts, queue_s: float) -> str:
    """What the request queued behind: its model's inputs (the scheduler's depth, not the
    other models' batches on the shared compute slots), unknown without the engine's
    trace (it traces only a request slow there)."""
    engine = facts.engine
    if engine is None:
        return f"queued {_ms(queue_s)} (the engine sent no trace: the queue's depth is unknown)"
    queued = f"queued {_ms(queue_s)} behind {engine.queue_depth_at_arrival} inputs of its model"
    if engine.busy_compute_slots_at_arrival > 0:
        busy, slots = engine.busy_compute_slots_at_arrival, engine.compute_slots
        queued += (
            f"; {busy} of the {slots} compute slots shared by every model were running "
            f"a batch when it arrived"
        )
    return queued


def _net(phase_s: float, lost_s: float) -> float:
    """What a phase of `phase_s` holds beyond the `lost_s` a root cause took of it (a 200 ms
    collection during a 205 ms phase leaves it 5)."""
    return max(0.0, phase_s - lost_s)


def rank(causes: list[Cause], total_s: float) -> list[Cause]:
    """Causes worth naming, most time first (ties go to the more specific cause), together
    never more than the request's `total_s`: root causes that explain the same time (a GPU
    throttled and an allocator retry, both the batch's excess) count it once, the first."""
    ranked = sorted(causes, key=lambda c: (-round(c.seconds, 4), CAUSES.index(c.name)))
    kept: list[Cause] = []
    left = total_s
    for cause in ranked:
        seconds = min(cause.seconds, left)
        if seconds >= MIN_CAUSE_S:
            kept.append(Cause(cause.name, seconds, cause.evidence))
            left -= seconds
    return kept
