"""What every task's front-end pipeline shares: start-up (tokenizers, engine connection),
the probes' verdicts, the served models, shedding from headers alone (the engine's
published backlog, token bucket, in-flight cap), each request's admission and engine round
trip (`begin` then `compute`: token bucket by cost -> send to the engine -> read its
stream) and the tokenizer pool (`tokenizer_pool.py`); `drain.py` drains it on shutdown.

The per-task pipelines call it: `embedding_service.py` (texts to vectors),
`tensor_service.py` (tensors) and `generation/pipeline.py` (text generation).

`Service` is created and called on its front end's event loop thread; large inputs are
tokenized on a small thread pool. It never imports torch: the model lives in the engine
(another process, or `inprocess.py` in tests), reached through an `EngineClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, TypeVarTuple

from app.admission import Admission, AdmissionLimits, Entry, Rejected, RejectReason
from app.deadlines import resolve_deadline
from app.drain import Drain
from app.engine.client import EngineClient, EngineRefused, EngineUnavailable
from app.engine.protocol import EngineStatus, ModelInfo, OutputPayload, Payload, Submit
from app.failures import DeadlineExceeded
from app.gate import AdmissionGate
from app.heap import freeze_startup_heap
from app.metrics import Metrics
from app.model_queues import shed_verdict
from app.model_specs import ModelSpec
from app.models.tokenizer import TextTokenizer
from app.probes import Readiness, liveness, readiness
from app.settings import Settings
from app.timing import PhaseTimer
from app.tokenizer_pool import TokenizerLoader, TokenizerPool, load_model_tokenizer

log = logging.getLogger(__name__)

# A text longer than this many characters per allowed token is refused (or, with
# truncation, cut) before tokenizing: a 1 MiB input must not cost a tokenizer pass.
MAX_CHARS_PER_TOKEN = 32

Args = TypeVarTuple("Args")
Result = TypeVar("Result")


class UnknownModel(Exception):
    def __init__(self, name: str, known: Sequence[str]) -> None:
        super().__init__(f"model {name!r} is not served; available: {', '.join(known)}")


class WrongTask(Exception):
    """A request for a task the model does not do (a client's mistake: 400)."""

    def __init__(self, model: str, task: str, *wanted: str) -> None:
        super().__init__(f"model {model!r} does {task!r}, not {' or '.join(map(repr, wanted))}")


@dataclass  # not frozen: the request's code marks it as it ends
class Outcome:
    """How a request at the engine ended, for its duration's label (`Service.at_engine`)."""

    name: str = "error"

    def ok(self) -> None:
        self.name = "ok"


class Service:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        engine: EngineClient,
        tokenizer_loader: TokenizerLoader = load_model_tokenizer,
        frontend_processes: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.engine = engine
        self._tokenizer_loader = tokenizer_loader
        self.clock = clock  # also the clock of the pipelines built on this service
        self.admission = Admission(
            AdmissionLimits(
                max_inflight=settings.max_inflight,
                default_timeout_s=settings.default_timeout_ms / 1000,
                max_timeout_s=settings.max_timeout_ms / 1000,
                max_body_reads=settings.max_body_reads,
            )
        )
        self.gate = AdmissionGate(
            self.admission,
            rate_per_s=settings.rate_limit_per_s / frontend_processes,
            burst=settings.rate_limit_burst,
            max_wait_s=settings.max_admission_wait_ms / 1000,
            metrics=metrics,
            clock=clock,
        )
        self.tokenizers: dict[str, TextTokenizer] = {}
        self.tokenizer_pool = TokenizerPool(settings.tokenizer_threads)
        self._startup_error: str | None = None
        self._started = False  # tokenizers loaded and the engine connected
        self.drain = Drain(self.admission)  # stop admitting, wait until answered
        # Requests let in that are at the engine (sent, not yet answered): the rest of those
        # in flight are still being read or tokenized, work the engine has not seen yet.
        self._at_engine = 0

    # --- start-up -----------------------------------------------------------------------
    async def start(self) -> None:
        """Load the tokenizers and connect to the engine. A failure is kept for the probes
        (logged in full, reported without detail), not raised."""
        try:
            largest = self.settings.length_buckets[-1]
            for spec in self.settings.models:
                if spec.task in ("embed", "generate"):  # other tasks take no text
                    self.tokenizers[spec.name] = await asyncio.to_thread(
                        self._tokenizer_loader, spec, largest
                    )
            await self.engine.start()
            freeze_startup_heap("frontend")
            self._started = True
        except Exception as error:
            log.exception("front-end start-up failed")
            self._startup_error = f"front-end start-up failed: {type(error).__name__}"

    @property
    def started(self) -> bool:
        """Start-up (tokenizers loaded, engine connected) succeeded."""
        return self._started

    def engine_status(self) -> EngineStatus | None:
        return self.engine.status()

    def readiness(self) -> Readiness:
        return readiness(
            self.engine_status(),
            self._startup_error,
            self.admission.draining,
            can_serve=self._started,
            restart=self.engine.restart_under_way(),
        )

    def liveness(self) -> str | None:
        """None while this server should be left running; else why it should be restarted."""
        return liveness(self.engine_status(), self._startup_error)

    def model_names(self) -> list[str]:
        return [spec.name for spec in self.settings.models]

    def output_width(self, name: str) -> int | None:
        """The model's output vector width, once the engine has loaded it."""
        info = self.model_info(name)
        return info.output_width if info else None

    def model_task(self, name: str) -> str:
        return self.model_spec(name).task

    def require_task(self, name: str, task: str) -> ModelSpec:
        """The spec of served model `name`; raises `WrongTask` (400) unless it does `task`."""
        spec = self.model_spec(name)
        if spec.task != task:
            raise WrongTask(name, spec.task, task)
        return spec

    def model_spec(self, name: str) -> ModelSpec:
        return next(spec for spec in self.settings.models if spec.name == name)

    # --- shedding before the body is read ---------------------------------------------------
    def shed(
        self, envoy_timeout_ms: float | None, model: str | None = None, task: str | None = None
    ) -> Entry | Rejected:
        """What can be refused from headers alone, at almost no cost: draining, no ready
        engine, the predicted wait over the delay budget (of `model` when the path names it,
        else of the least loaded model of the path's `task`: `model_queues.shed_verdict`),
        an empty token bucket, the in-flight cap and the allowance for bodies being read
        (counted from here on, so they bound the requests this front end holds). The
        rejection is counted here; the caller answers it. An `Entry`: the request is in,
        and the caller must call `body_arrived` once its body is read and `leave` once it
        is answered."""
        self.drain.arrived()
        verdict = self._shed_reason(envoy_timeout_ms, model, task)
        if isinstance(verdict, Rejected):
            self.metrics.rejected.labels("", verdict.reason.value).inc()
        return verdict

    def body_arrived(self, entry: Entry) -> Rejected | None:
        """The body of a request `shed` let in has been read: None once it counts in flight;
        else the refusal (429 `inflight`, counted here, with no model: the body is not parsed
        yet) of one whose body came so late that the cap filled meanwhile."""
        rejection = self.admission.body_arrived(entry, self.clock())
        if rejection is not None:
            self.metrics.rejected.labels("", rejection.reason.value).inc()
        return rejection

    def leave(self, entry: Entry) -> None:
        """A request that `shed` let in was answered (whatever the outcome)."""
        self.admission.leave(entry, self.clock())
        self.metrics.inflight.dec()
        self.drain.left()

    def _ready_status(self) -> EngineStatus | None:
        """The engine's status while this front end can serve (started, engine ready)."""
        status = self.engine_status()
        if status is None or status.state != "ready" or not self._started:
            return None
        return status

    @staticmethod
    def _not_ready() -> Rejected:
        return Rejected(RejectReason.NOT_READY, "the engine is not ready", 1.0)

    def _shed_reason(
        self, envoy_timeout_ms: float | None, model: str | None, task: str | None
    ) -> Entry | Rejected:
        """Its `Entry` once the request is let in (the caller must then call `leave`); else
        why not."""
        if self.admission.draining:
            return self.admission.draining_rejection()
        if (status := self._ready_status()) is None:
            return self._not_ready()
        now = self.clock()
        deadline = resolve_deadline(now, self.admission.limits, None, envoy_timeout_ms)
        # What this front end sent that the engine does not hold yet, and what it let in
        # but has not sent (one input each, at least; the requests still tokenized, or read
        # within their grace: a body that does not come stops counting as work to come).
        unsent = max(0, self.admission.held(now) - self._at_engine)
        sent = self.engine.inputs_in_transit(status) + unsent
        budget_s = self.settings.max_queue_delay_ms / 1000
        verdict = shed_verdict(status, sent, deadline, now, budget_s, model, task)
        if verdict is not None:
            return verdict
        if not self.gate.has_capacity(self.settings.length_buckets[0]):
            return self.admission.rate_limited(
                self.settings.length_buckets[0], self.gate.rate_per_s
            )
        entered = self.admission.enter(now)
        if isinstance(entered, Entry):
            self.metrics.inflight.inc()
        return entered

    # --- requests -----------------------------------------------------------------------
    def resolve_model(self, name: str | None) -> str:
        chosen = name or self.settings.default_model_name
        if chosen not in self.model_names():
            raise UnknownModel(chosen, self.model_names())
        return chosen

    @contextlib.contextmanager
    def at_engine(
        self, model: str, task: str, arrived_at: float, *, counts_engine_refusals: bool = False
    ) -> Iterator[Outcome]:
        """Wrap an admitted request's time at the engine, from sending it to its last
        answer. While in it, shedding counts it as sent (its inputs are then the engine
        client's to count until the engine's status holds them). On the way out its
        duration since `arrived_at` is observed by model, `task` and outcome: "ok" once the
        caller called `outcome.ok()`, else named by what ended it (a refusal, a deadline,
        a cancellation or client gone, a request the engine refused as sent, any other
        error). `counts_engine_refusals`: the request was sent as several Submits marked
        `Submit.refusal_counted_by_sender`, so its refusal by the engine (or expiry there)
        is counted here, once, not by the engine once per Submit."""
        self._at_engine += 1
        outcome = Outcome()
        try:
            yield outcome
        except Rejected as rejection:
            deadline = rejection.reason is RejectReason.DEADLINE
            outcome.name = "deadline" if deadline else "rejected"
            if rejection.reason is RejectReason.ENGINE_LOST or counts_engine_refusals:
                # Decided here, by the engine client (the engine counts its own refusals).
                self.metrics.rejected.labels(model, rejection.reason.value).inc()
            raise
        except DeadlineExceeded:
            outcome.name = "deadline"
            if counts_engine_refusals:
                self.metrics.rejected.labels(model, RejectReason.DEADLINE.value).inc()
            raise
        except EngineRefused:
            outcome.name = "bad_request"  # answered 400: the client's doing, not an error
            raise
        except EngineUnavailable:
            # Answered 503 `not_ready` (no engine connected, or one that stopped answering):
            # a refusal decided here, which no engine counts.
            outcome.name = "rejected"
            self.metrics.rejected.labels(model, RejectReason.NOT_READY.value).inc()
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome.name = "cancelled"
            raise
        finally:
            self._at_engine -= 1
            elapsed = self.clock() - arrived_at
            self.metrics.request_duration.labels(model, task, outcome.name).observe(elapsed)

    def model_info(self, name: str) -> ModelInfo | None:
        """What the engine published about the model, once it has loaded it."""
        status = self.engine_status()
        return status.models.get(name) if status else None

    def begin(
        self, model: str, timeout_ms: float | None, envoy_timeout_ms: float | None
    ) -> tuple[float, float]:
        """A request's arrival time and deadline; raises `Rejected` (counted) without a
        ready engine. Any task's first step, for a request `shed` let in: one that entered
        before a drain began finishes, so draining refuses nothing here."""
        self.drain.arrived()
        now = self.clock()
        if self._ready_status() is None:
            raise self.gate.reject(self._not_ready(), model)
        return now, resolve_deadline(now, self.admission.limits, timeout_ms, envoy_timeout_ms)

    async def compute(
        self,
        model: str,
        task: str,
        payload: Payload,
        *,
        cost: int,
        deadline: float,
        arrived_at: float,
        timer: PhaseTimer,
        check: Callable[[OutputPayload], None] = lambda payload: None,
    ) -> OutputPayload:
        """Admit a checked request (`cost` bucket tokens: its model tokens, or elements),
        send it to the engine and return its final output; counts its duration by model,
        `task` and outcome. Raises `Rejected` (429/503/504), `DeadlineExceeded`,
        `EngineRefused` or `BatchFailed`, or what `check` raises for the final output (an
        answer the front end cannot send). Cancelling the caller's task (client gone)
        cancels the request in the engine, dropping its queued inputs."""
        started = self.clock()
        await self.gate.admit(model, cost, deadline)
        admitted_at = self.clock()
        timer.add("admission", admitted_at - started)
        request = Submit(self.engine.next_request_id(), model, deadline, payload)
        with self.at_engine(model, task, arrived_at) as outcome:
            try:
                # Closed here, not left to the garbage collector: an async generator
                # dropped unfinished is closed through the loop's finalizer hook, a
                # thread-safe wake-up and a task of its own per request.
                async with contextlib.aclosing(self.engine.stream(request)) as outputs:
                    async for output in outputs:
                        timer.add("queue", output.queue_s)
                        timer.add("compute", output.compute_s)
                        timer.engine_trace = output.trace
                        if output.final:
                            check(output.payload)  # what it raises ends the request, not ok
                            outcome.ok()
                            return output.payload
            except DeadlineExceeded:
                # No output came back to say where the time went: a request that reached its
                # deadline at the engine waited there, and a slow-request report must not
                # call that time unaccounted.
                if "queue" not in timer.phases:
                    timer.add("queue", self.clock() - admitted_at)
                raise
            except EngineUnavailable:
                timer.add("engine_lost", self.clock() - admitted_at)
                raise
            except Rejected as rejection:
                if rejection.reason is RejectReason.ENGINE_LOST:
                    # Its wait went with the engine: a slow-request report names it.
                    timer.add("engine_lost", self.clock() - admitted_at)
                raise
            raise EngineUnavailable("the engine's stream ended without an output")

    async def run_tokenizer(
        self,
        chars: int,
        timer: PhaseTimer | None,
        work: Callable[[*Args], Result],
        *args: *Args,
    ) -> Result:
        """`work(*args)` inline or on the tokenizer pool (`TokenizerPool.run`). Event loop
        thread."""
        return await self.tokenizer_pool.run(chars, timer, work, *args)

    # --- shutdown -----------------------------------------------------------------------
    async def stop(self) -> None:
        await self.engine.close()
        self.tokenizer_pool.shutdown()
