"""Pure: each model's own predicted wait, what admission judges a request for it by, in
the engine (`wait_ahead`) and in front ends (`shed_verdict`, from `ModelQueue`s published in
the engine's status).

A request for model M waits for what is left of the batches running now (on every compute
slot: a slot frees when any batch ends), for M's own queue, and for the batches other
models run meanwhile: the compute slots are handed out first come, one place in line per
model, and a model that took a slot rejoins the line at its back (`compute_slots.py`), so
every other model with work takes a turn before each of M's batches queued ahead of the
input and before its own batch: k batches of M ahead, k + 1 batches of each other model,
as many as it has (its next batch's compute each). Other models' queues beyond those turns
are not ahead of it: judged on the whole engine's backlog, a flood on one model had every
request for any other refused 429 `queue`, however idle that model was; counting one batch
of each, whatever M's own queue, admitted requests whose real wait was a multiple of the
budget when two models were flooded. A generate model's input also waits for a KV-cache
slot (`own_wait_s`: its running sequences' steps, each step a turn of the others). With
one model served this is the whole engine's backlog, as before.

Which of M's batches are ahead depends on the input's length bucket: in its own bucket it
joins a partial batch, but a partial batch in another bucket runs first (the scheduler takes
ready buckets oldest first), and a request of more rows than a batch waits for the others'
turns between its own batches. The engine, which knows the bucket, counts a turn before each
batch queued in M's other buckets and each of its own bucket's up to the one its last input
runs in (`rounds`: `rows.admit_rows`). The published queue, which front ends judge before
the body (the bucket unknown), counts all of M's batches but one partial batch an input may
join (`ModelWork.batches_ahead`): the least of those over the buckets, so a front end never
refuses what the engine would admit.

No asyncio, no torch, no clock: callers pass their figures, tests call these directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.admission import RETRY_AFTER_UNKNOWN_S, Rejected, RejectReason, published_queue_verdict
from app.engine.protocol import EngineStatus, ModelQueue


@dataclass(frozen=True, slots=True)
class BatchCost:
    """A model's measured cost in its smallest shape (zeros until warm-up measured it):
    what one more queued input adds to its queue's compute, a full batch's rows and compute
    seconds (`admit` counts the queue in such batches), and the least a request's own
    batch adds on top of the backlog (one input)."""

    seconds_per_input: float
    batch_rows: int
    full_batch_s: float
    least_own_compute_s: float


@dataclass(frozen=True, slots=True)
class ModelWork:
    """One model's work now, in compute seconds on one slot (not divided among slots):
    what is left of its running batches, its queued inputs run in full batches, and the
    batch (or generation step) it would run next when it has work ready, else 0; and
    in turns on the compute slots: its batches (steps) an input queued for it now
    waits behind (`batches_ahead`: each is a turn of every other model; in whichever
    length bucket the input queues, the least: see above), and those its work
    takes at most (`turns`: no other model's input waits for more of them). A generate
    model's input also waits for a KV-cache slot (`own_wait_s`, in its own steps: not
    shared among the compute slots, nor part of the engine's backlog); and `at_cap` says
    the engine refuses every new input for it (429 `queue`): `generate_max_waiting`
    sequences wait for a KV-cache slot and none is free."""

    running_s: float
    queued_s: float
    next_batch_s: float
    batches_ahead: int = 0
    turns: int = 1
    own_wait_s: float = 0.0
    at_cap: bool = False


NO_WORK = ModelWork(0.0, 0.0, 0.0)


def wait_ahead(
    model: str, works: Mapping[str, ModelWork], workers: int, rounds: int | None = None
) -> float:
    """Predicted seconds before an input queued now for `model` starts, its own queue
    included (divided among the `workers` compute slots): every model's running batches,
    `model`'s own queued inputs, and of each other model with work ready a next batch for
    each of `rounds` (`model`'s batches up to and including the input's own: by default
    its batches ahead and one more), as many as it has (at least one); then its own wait
    (`own_wait_s`: a KV-cache slot's, not divided)."""
    return _Totals(works).wait_ahead(model, workers, rounds)


def waits_ahead(works: Mapping[str, ModelWork], workers: int) -> dict[str, float]:
    """`wait_ahead` of every model of `works`, what they share summed once."""
    totals = _Totals(works)
    return {model: totals.wait_ahead(model, workers) for model in works}


class _Totals:
    """Every model's work, its running batches summed once, for `wait_ahead`."""

    def __init__(self, works: Mapping[str, ModelWork]) -> None:
        self.works = works
        self.running = sum(work.running_s for work in works.values())

    def wait_ahead(self, model: str, workers: int, rounds: int | None = None) -> float:
        work = self.works.get(model, NO_WORK)
        if rounds is None:  # another model's turn before each batch ahead, and its own
            rounds = work.batches_ahead + 1
        others = sum(
            min(rounds, max(1, other.turns)) * other.next_batch_s
            for name, other in self.works.items()
            if name != model
        )
        return (self.running + work.queued_s + others) / workers + work.own_wait_s


def published_queue(
    wait_s: float, queued_inputs: int, cost: BatchCost | None, workers: int, at_cap: bool = False
) -> ModelQueue:
    """A model's `ModelQueue`: its wait ahead (`wait_ahead`), its queued inputs and its own
    cost, the per-input rate divided among the `workers` (zeros for a cost not measured
    yet, and for a model that queues nothing in batches: `cost` None), and whether the
    engine refuses every new input for it (`ModelWork.at_cap`)."""
    measured = cost is not None and cost.seconds_per_input > 0
    return ModelQueue(
        backlog_s=wait_s,
        seconds_per_input=cost.seconds_per_input / workers if cost and measured else 0.0,
        queued_inputs=queued_inputs,
        least_own_compute_s=max(0.0, cost.least_own_compute_s) if cost else 0.0,
        batch_rows=cost.batch_rows if cost and measured else 1,
        full_batch_s=cost.full_batch_s if cost and measured else 0.0,
        at_cap=at_cap,
    )


def queue_verdict(
    queue: ModelQueue, sent: int, deadline: float, now: float, budget_s: float
) -> Rejected | None:
    """A front end's verdict on one model's published queue: refused as the engine refuses
    every input for a model at its cap (429 `queue`, retry after its wait), else
    `admission.published_queue_verdict`."""
    if queue.at_cap:
        message = "generate_max_waiting sequences wait for a KV-cache slot, none free"
        return Rejected(RejectReason.QUEUE, message, queue.backlog_s or RETRY_AFTER_UNKNOWN_S)
    return published_queue_verdict(queue, sent, deadline, now, budget_s)


def naming(model: str, rejection: Rejected | None) -> Rejected | None:
    """`rejection`, its message naming `model` (whose own wait it is)."""
    if rejection is None:
        return None
    message = f"model {model!r}: {rejection.message}"
    return Rejected(rejection.reason, message, rejection.retry_after_s)


def shed_verdict(
    status: EngineStatus,
    sent: int,
    deadline: float,
    now: float,
    budget_s: float,
    model: str | None = None,
    task: str | None = None,
) -> Rejected | None:
    """A front end's verdict before a request's body is read, from each model's own
    published queue plus the `sent` inputs the engine does not hold yet
    (`admission.published_queue_verdict`). For `model` (named by the path: v2) its own
    queue alone, the refusal naming it; for a request whose model is in its body, refused
    only when every model of `task` (the path's: any when None, or when none is of it)
    would refuse it: then the least loaded one's refusal (429
    `queue` with the soonest Retry-After before a 504 `deadline`). Whose `sent` inputs are
    is not known before their bodies: they count against every model. An engine that
    publishes no model's queue is judged on its whole backlog."""
    infos = status.models
    if model is not None and model in infos:
        queue = infos[model].queue
        if queue is not None:
            return naming(model, queue_verdict(queue, sent, deadline, now, budget_s))
    published = [(info.task, info.queue) for info in infos.values() if info.queue is not None]
    # /v1/embeddings reaches no generate model: their short waits must not let its flood in.
    queues = [q for of, q in published if of == task] or [q for _, q in published]
    if not queues:
        return published_queue_verdict(status, sent, deadline, now, budget_s)
    least: Rejected | None = None
    for queue in queues:
        verdict = queue_verdict(queue, sent, deadline, now, budget_s)
        if verdict is None:
            return None
        if least is None or _sooner(verdict, least):
            least = verdict
    return least


def _sooner(refusal: Rejected, than: Rejected) -> bool:
    """Whether `refusal` tells a client it may retry sooner than `than`: a 429 `queue`
    (retryable) before a 504 `deadline`, the shorter Retry-After among 429s."""
    if refusal.reason is not RejectReason.QUEUE:
        return False
    if than.reason is not RejectReason.QUEUE:
        return True
    return (refusal.retry_after_s or 0.0) < (than.retry_after_s or 0.0)
