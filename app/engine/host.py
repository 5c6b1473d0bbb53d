"""The seam a task plugs into: one served model inside the engine, whatever it computes.

`EngineCore` keeps no task-specific logic. For each configured model it asks the task's
`HostFactory` (registered in `tasks.py`) for a `ModelHost`, and from then on only routes
protocol messages to it and sums what hosts report for the engine's status. A new task
(generation, tensors) adds a payload and output type to `protocol.py`, a host module and
one line in `tasks.py`; nothing else in the engine changes.

Every method is called on the engine's event loop thread; hosts run their compute on the
dispatcher's threads (`EngineContext.dispatcher`), inside the shared `ComputeSlots`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from app.admission import Rejected
from app.compute_slots import ComputeSlots
from app.dispatcher import Dispatcher
from app.engine.protocol import BatchTrace, EngineTrace, FromEngine, ModelInfo, Submit
from app.metrics import Metrics
from app.model_queues import BatchCost as BatchCost
from app.model_queues import ModelWork
from app.model_specs import ModelSpec
from app.settings import Settings
from app.startup import RunnerLoader

Emit = Callable[[FromEngine], None]
ShapeDone = Callable[[int, int], None]  # (shapes warmed up so far, total) after each shape


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The load a request for `model` meets when it arrives, for its host's admission
    decision: that model's own queued inputs (what `max_queue` caps, per model) and its
    predicted seconds before newly queued work starts (`model_queues.wait_ahead`: every
    running batch, its own queue, a batch of each other model with work before each of its
    batches ahead and before its own, divided among the compute threads), the time now,
    the settings' caps, and the compute threads that wait is divided among; and every
    model's work it was computed from (`works`: the engine always passes it), so that a
    batched host counts the turns its request's own length bucket waits for
    (`rows.bucket_wait`); None (a load built by hand) judges on `backlog_s` alone."""

    model: str
    queued_inputs: int
    backlog_s: float
    now: float
    max_queue: int
    max_queue_delay_s: float
    workers: int = 1
    works: Mapping[str, ModelWork] | None = None


class RequestTracer(Protocol):
    """Builds a request's `EngineTrace` for slow-request reports (docs/SPIKES.md): `arrive`
    when it is queued (None while reports are off), `finish` when its last output goes."""

    def arrive(self, queue_depth: int) -> object | None: ...

    def finish(self, arrival: object | None, batch: BatchTrace | None) -> EngineTrace | None: ...


@dataclass(frozen=True, slots=True)
class EngineContext:
    """What a host may use: the settings, the engine's device, dispatcher threads and the
    compute slots every host shares, metrics, the injected clock, the health recorder (call
    once per batch with its exception, or None; a host's counts under its model's name:
    `loading.load_hosts`), whether the device was lost by another failure than a given
    one (`BatchHealth.lost_device_before`: a failed batch's answer), a check to run on the
    compute thread before each batch, the embedding loader (tests inject fakes), and the
    request tracer."""

    settings: Settings
    device: torch.device
    dispatcher: Dispatcher
    slots: ComputeSlots
    metrics: Metrics
    clock: Callable[[], float]
    record_batch: Callable[[BaseException | None], None]
    lost_device_before: Callable[[BaseException], bool]
    before_batch: Callable[[], None]
    loader: RunnerLoader
    tracer: RequestTracer


class ModelHost(Protocol):
    """One served model in the engine (event loop thread only)."""

    name: str
    # Whether its requests queue rows into batches (`batch_cost` is not None): what
    # `max_queue` caps and front ends count in batches (generate prompts wait for KV slots).
    queues_batches: bool

    def info(self) -> ModelInfo:
        """What front ends learn of the model from the engine's status."""
        ...

    @property
    def warmup_total(self) -> int:
        """Shapes `warm_up` will run (0 when warm-up is off)."""
        ...

    async def warm_up(self, shape_done: ShapeDone) -> None:
        """Run every shape once before the engine reports ready."""
        ...

    def start(self) -> None:
        """Begin serving (after warm-up)."""
        ...

    def work(self, now: float) -> ModelWork:
        """This model's running and queued work and the batch it would run next, in compute
        seconds (not yet divided among compute threads): what every model's admission
        counts (`model_queues.wait_ahead`)."""
        ...

    def batch_cost(self) -> BatchCost | None:
        """What this model's requests cost the shared compute threads, for the engine's
        status; None for a host whose requests queue no batches."""
        ...

    def queued_inputs(self) -> int: ...

    def admit(self, request: Submit, load: EngineLoad) -> Rejected | None:
        """None to queue the request; else why it is refused (429/503/504). A request the
        model cannot serve as sent is not refused here: `submit` answers it 400."""
        ...

    def submit(self, request: Submit, emit: Emit) -> asyncio.Task[None] | None:
        """Queue an admitted request. Its answer goes to `emit`: zero or more `Output`s,
        then either a `final` one or one `Failure` (nothing after either). Returns the task
        answering it (cancelling it drops the request's queued work and sends nothing
        more), or None when it was answered at once (e.g. a `BAD_REQUEST` failure)."""
        ...

    def refresh_gauges(self) -> None:
        """Set this model's gauges (pool slots, cache usage, ...)."""
        ...

    def debug_report(self) -> dict[str, object]:
        """This model's part of `/debug/pool`."""
        ...

    async def close(self) -> None:
        """Finish queued and running work, then stop."""
        ...


HostFactory = Callable[[ModelSpec, EngineContext], Awaitable[ModelHost]]


def payload_kind(request: Submit) -> str:
    """The task a request's payload is for (its msgpack tag), for a host's error message
    when it is sent another task's payload."""
    return f"a {type(request.payload).__struct_config__.tag!s} request"
