"""The `generate` task in the engine: continuous batching over the preallocated KV cache.

Each request is one sequence. It waits for a free cache slot (`kv_slots.py`), joins the
running batch at the next step with its prompt (prefill: a chunk of at most
`generate_prefill_chunk_tokens` a step, the last choosing its first token), then gets one
token per step until EOS or `max_new_tokens`; each step streams the new tokens as an
`Output`, the last one `final` with its `FinishReason` (a request that does not stream gets
only that last one, with every token). A sequence that fails (its deadline passed, its
prompt or its step failed: `generation_triage.py`) gets the outputs it was already given,
then one `Failure` instead of a final output. Sequences join and leave between dispatches; a
dispatch is one prefill forward for the joiners and one batched decode forward for the rest,
run on a dispatcher compute thread inside one of the compute slots every model shares, so
embedding batches and generation steps interleave without oversubscribing the CPU/GPU.

With `generate_steps_per_dispatch` > 1 (default 16), a dispatch nobody joins runs up to
that many decode steps in a row (`generation_runs.py`; `steps_for` stops at a sequence's
length), handing each step over as it ends while the next computes
(`generation_hand_over.py`: a streamed sequence's tokens each step, the others' as the run
ends or their row leaves it), interrupted by an arrival that could take a free slot, a
cancel, an expiry or another model in line for the compute slots, and ended by a row's EOS
while a sequence waits for a slot (also one that arrived during the run).

A cancelled (client gone) or expired sequence gives its slot back at once: its keys are
read again only as a later prompt's reused prefix (`slot_table.py`; a slot is zeroed after
non-finite logits or a failed prefill; a failed step's slots are not reused). The host
runs the step loop; admission is `generation_admission.py`'s, waiting and slots
`generation_batch.py`'s, running a step `generation_steps.py`'s, a sequence and its outputs
`generation_sequences.py`'s.
Event loop thread only; steps and warm-up run on dispatcher compute threads.
"""

from __future__ import annotations

import asyncio
import logging

from app.admission import Rejected, RejectReason
from app.engine import generation_reports, kv_slots
from app.engine.generation_admission import GenerationAdmission
from app.engine.generation_batch import SequenceTable
from app.engine.generation_hand_over import StepHandOver
from app.engine.generation_sequences import GenerationSequence, steps_for
from app.engine.generation_steps import StepResult, StepRunner
from app.engine.generation_triage import StepTriage
from app.engine.host import Emit, EngineContext, EngineLoad, ShapeDone, payload_kind
from app.engine.lost_device import server_fault
from app.engine.protocol import (
    Failure,
    FailureKind,
    FinishReason,
    GeneratePayload,
    ModelInfo,
    Output,
    Submit,
)
from app.model_queues import ModelWork
from app.models.causal_lm import CausalLMRunner
from app.models.sampling import NO_TOKEN, new_generator

log = logging.getLogger(__name__)


class GenerationHost:
    def __init__(self, runner: CausalLMRunner, context: EngineContext) -> None:
        self.name = runner.name
        self.runner = runner
        self._context = context
        settings = context.settings
        slots, reuse = runner.cache.shape.slots, settings.generate_prefix_reuse
        self._batch = SequenceTable(slots, reuse, lambda: self._steps.run_steps)  # (below)
        self._admission = GenerationAdmission(runner, self._batch, settings)
        self._max_batch_tokens = settings.generate_max_batch_tokens
        self._max_waiting = settings.generate_max_waiting
        self._steps_per_dispatch = settings.generate_steps_per_dispatch
        self._chunk_tokens = settings.generate_prefill_chunk_tokens
        # Outputs of the last step, sent while the next one computes; kept here (each as it
        # is made) so that a loop that fails in between, or while handling the step, still
        # sends them (those sequences are done).
        self._outbox: list[tuple[GenerationSequence, Output]] = []
        self._step_s = 0.0  # smoothed seconds per step while busy
        self._wakeup = asyncio.Event()
        context.slots.listen(self._wakeup)
        self._steps = StepRunner(runner, context, self._wakeup, self._batch.slots.forget)
        self._triage = StepTriage(
            self._steps, self._batch, self._emit_failure, self._advance, context
        )
        self._loop_task: asyncio.Task[None] | None = None
        self._hand_over = StepHandOver(self._advance, self._between_steps, self._steps.interrupt)
        self._closing = False
        # Labelled once: these are touched for every token.
        self._tokens_counter = context.metrics.output_tokens.labels(self.name)
        self._first_token_histogram = context.metrics.time_to_first_token.labels(self.name)
        self._reused_counter = context.metrics.prefix_reused_tokens.labels(self.name)

    # --- status -------------------------------------------------------------------------
    def info(self) -> ModelInfo:
        return ModelInfo(
            task=self.runner.task,
            output_width=self.runner.vocab_size,
            max_input_tokens=self.runner.max_sequence_tokens - 1,
        )

    @property
    def warmup_total(self) -> int:
        return self._steps.warmup_total

    async def warm_up(self, shape_done: ShapeDone) -> None:
        """The step shapes serving will run (`StepRunner.warm_up`); the last (every slot
        decoding) seeds the step-time estimate."""
        self._step_s = await self._steps.warm_up(shape_done)

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._supervised_loop(), name=f"generate-{self.name}")

    def _slot_wait_seconds(self) -> float:
        """Predicted seconds before a sequence queued now gets a KV-cache slot."""
        return self._batch.steps_until_a_slot() * self._step_s

    def work(self, now: float) -> ModelWork:
        """Its sequences' turns on the compute slots (`SequenceTable.work`)."""
        return self._batch.work(self._step_s, self._max_waiting)

    queues_batches = False  # a generate request queues no batch (`work`): no `batch_cost`

    def batch_cost(self) -> None:
        return None

    def queued_inputs(self) -> int:
        return len(self._batch.waiting)

    # --- requests -----------------------------------------------------------------------
    def admit(self, request: Submit, load: EngineLoad) -> Rejected | None:
        return self._admission.admit(request, load, self._step_s)

    def submit(self, request: Submit, emit: Emit) -> asyncio.Task[None] | None:
        payload = request.payload
        if not isinstance(payload, GeneratePayload):
            message = f"model {self.name!r} generates text; it was sent {payload_kind(request)}"
            emit(Failure(request.request_id, FailureKind.BAD_REQUEST, message))
            return None
        problem = kv_slots.payload_problem(payload, self.runner)
        if problem is not None:
            emit(Failure(request.request_id, FailureKind.BAD_REQUEST, problem))
            return None
        time_left = request.deadline - self._context.clock()
        slot_wait_s = self._slot_wait_seconds()
        sampling = self._admission.fitted(request, payload, time_left, slot_wait_s, self._step_s)
        sequence = GenerationSequence(
            request=request,
            prompt=list(payload.prompt_ids),
            sampling=sampling,
            streams=payload.stream,
            emit=emit,
            generator=new_generator(payload.sampling.seed),
            arrived=self._context.clock(),
            done=asyncio.get_running_loop().create_future(),
            arrival_trace=self._context.tracer.arrive(len(self._batch.waiting)),
            chunk_tokens=self._chunk_tokens,
        )
        self._batch.queue(sequence)
        if self._batch.slots.free > 0:
            self._steps.interrupt()  # it can join at the next step
        else:
            self._steps.sequence_waits()  # a row ending at EOS in the run frees its slot
        self._wakeup.set()
        task = asyncio.create_task(self._answer(sequence))
        # On the task, not in it: a cancel that comes before the task first runs (its
        # Submit and Cancel read in one turn) never reaches the coroutine's own code.
        task.add_done_callback(lambda done: self._drop(sequence) if done.cancelled() else None)
        return task

    async def _answer(self, sequence: GenerationSequence) -> None:
        """Lives as long as the sequence; cancelling it (client gone) drops it (`submit`)."""
        await asyncio.shield(sequence.done)

    def _drop(self, sequence: GenerationSequence, row_ended: bool = False) -> None:
        """Forget a sequence wherever it is and give its slot back; no answer follows.
        `row_ended`: its row ended itself in the step that chose its last token (EOS, a stop
        id, its length: a run stops computing it, `generation_runs.decode_run`)."""
        if not sequence.done.done():
            sequence.done.set_result(None)
        if self._batch.remove(sequence) and (not row_ended or self._batch.waiting):
            # Stop computing its row, or let a waiting sequence take the slot at once.
            self._steps.interrupt()
        self._wakeup.set()

    def _fail(self, sequence: GenerationSequence, kind: FailureKind, message: str) -> None:
        self._emit_failure(sequence, Failure(sequence.request.request_id, kind, message))

    def _emit_failure(self, sequence: GenerationSequence, failure: Failure) -> None:
        self._drop(sequence)
        sequence.emit(failure)

    # --- the step loop ------------------------------------------------------------------
    async def _supervised_loop(self) -> None:
        """The step loop, restarted if it ever raises: its sequences fail (500) instead of
        waiting forever, and new ones are served."""
        while True:
            try:
                await self._loop()
                return
            except Exception as error:
                self._context.slots.withdraw(self._steps)
                self._batch.slots.forget_all()  # whatever a step in flight left in them
                self._context.record_batch(error)
                self._send_outbox()
                failed = self._batch.everyone()
                references = ", ".join(s.request.reference for s in failed) or "none"
                log.exception("%s: generation loop failed, failing %s", self.name, references)
                for sequence in failed:
                    why = server_fault("running its generation loop", error, sequence.request)
                    self._fail(sequence, FailureKind.FAILED, why)

    async def _loop(self) -> None:
        """Each turn starts the next step, then sends the previous step's outputs while it
        computes (the sending overlaps the compute instead of adding to every step)."""
        slots = self._context.slots
        while True:
            self._expire(self._context.clock())
            available = slots.available(self._steps)
            sequences = self._next_step() if available else []
            if not sequences:  # else `start` takes the slot, leaving the line
                has_work = bool(self._batch)
                slots.stand(self._steps, waiting=has_work and not available)
            # Streamed tokens go out a step at a time; the others' as a run ends (`held`).
            each_step = frozenset(s.slot for s in sequences if s.streams and s.slot is not None)
            held = frozenset(s for s in sequences if s.slot not in each_step)
            clock, spd = self._context.clock(), self._steps_per_dispatch
            run = steps_for(sequences, spd, clock, self._step_s) if sequences else 1
            step = (
                self._steps.start(
                    [s.row() for s in sequences],
                    run,
                    # A row ending at EOS frees a slot a waiting sequence can take at once.
                    end_on_eos=bool(self._batch.waiting),
                    listener=self._hand_over.listener(sequences, held),
                    each_step=each_step,
                )
                if sequences
                else None
            )
            if step is not None and run > 1:  # the forecast counts the steps its rows hold
                self._batch.hold(held)
            self._send_outbox()
            if step is None:
                if self._closing and not self._batch:
                    return
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                result = await step
            except Exception as error:  # blamed narrowly, on its slot (`generation_triage.py`)
                self._hand_over.raise_failure()
                self._hand_over.take_last()  # a failed run's steps before the failure
                self._batch.hold(frozenset())
                self._send_outbox()  # answers complete before it wait for no triage
                log.exception("%s: generation step failed; triaging it", self.name)
                await self._triage.answer(sequences, error)
                continue
            self._hand_over.raise_failure()
            self._record_step(result)
            self._hand_over.take_last()
            self._batch.hold(frozenset())

    def _between_steps(self, held: set[GenerationSequence]) -> None:
        """A run's step was taken (`_advance`) while the next one computes: send its
        outputs, and end the sequences a deadline ends now, but those whose tokens of the
        run the compute thread holds (`held`: checked when the run ends, with them)."""
        self._expire(self._context.clock(), held)
        self._send_outbox()

    def _send_outbox(self) -> None:
        outbox, self._outbox = self._outbox, []
        for sequence, output in outbox:
            sequence.emit(output)

    def _next_step(self) -> list[GenerationSequence]:
        """The next step's sequences: those joining now (their prompt's first chunk), then
        the running ones (the next chunk of a prompt being prefilled, or a decode row)."""
        joiners = self._batch.join(self._max_batch_tokens, self._context.clock())
        return joiners + [s for s in self._batch.running.values() if s not in joiners]

    def _expire(self, now: float, sparing: set[GenerationSequence] | None = None) -> None:
        """Sequences their deadline ends (`GenerationSequence.deadline_end`) end now, but
        those `sparing` names: past it, they fail (504) and free their slots; fitted to it,
        with `length`. The tokens they were given in the last step go out first (a stream
        ends at its failure)."""
        sequences = self._batch.everyone()
        if sparing:
            sequences = [s for s in sequences if s not in sparing]
        ending = [(s, end) for s in sequences if (end := s.deadline_end(now, self._step_s))]
        if ending:
            self._send_outbox()
        for sequence, end in ending:
            if end == "length":
                sequence.emit(self._finish(sequence, [], FinishReason.LENGTH, now))
                continue
            if not sequence.request.refusal_counted_by_sender:
                metrics = self._context.metrics
                metrics.rejected.labels(self.name, RejectReason.DEADLINE.value).inc()
            passed = f"deadline passed after {len(sequence.generated)} generated tokens"
            self._fail(sequence, FailureKind.DEADLINE, passed)

    def _record_step(self, result: StepResult) -> None:
        self._step_s = result.averaged_into(self._step_s)

    def _advance(self, sequences: list[GenerationSequence], tokens: list[list[int]]) -> None:
        """Give each sequence its new tokens (one output with them, for a sequence that streams: a
        step's token), and end those at EOS (not sent) or at their length, freeing their
        slots for the next step (zeroed if its logits broke down, also for one that left
        during the step). Outputs go to the outbox as they are made: an ended sequence is no
        longer the loop's; should this step fail later, only the outbox (`_supervised_loop`)
        answers it."""
        now = self._context.clock()
        eos = self.runner.eos_token_ids
        outbox = self._outbox  # empty: sent before the step was awaited
        for sequence, chosen in zip(sequences, tokens, strict=True):
            broken = NO_TOKEN in chosen  # its logits broke down: it fails after its tokens
            if not self._batch.is_running(sequence):  # cancelled or expired while it ran
                if broken and sequence.slot is not None:  # its slot, free, holds NaN: zero it
                    self._steps.clear_slot(sequence.slot)
                elif sequence.slot is not None:  # its row wrote its slot all the same
                    self._batch.slots.wrote(sequence.slot, sequence.resident_after(chosen))
                continue
            if broken:
                chosen = chosen[: chosen.index(NO_TOKEN)]
            if reused := sequence.chunk_computed():  # a prompt chunk's row: in its slot now
                self._reused_counter.inc(reused)  # its first step ran on what it reused
            if sequence.prefilling:  # not its prompt's last chunk: no token, no output
                if broken:  # its chunk's logits broke down: fail it, zero its slot
                    self._fail_non_finite(sequence)
                continue
            if sequence.first_token_at is None and chosen:
                sequence.first_token_at = now
                self._first_token_histogram.observe(now - sequence.arrived)
            fresh, finish = sequence.take(chosen, eos)
            if fresh:  # a held row's tokens come together; one ending at EOS (or a stop id)
                # chose its last kept token the step before the ending one
                ended_after = finish is FinishReason.EOS and len(chosen) > len(fresh)
                sequence.last_token_at = now - self._step_s if ended_after else now
                self._tokens_counter.inc(len(fresh))
            if finish is not None:
                ended = self._finish(sequence, fresh, finish, now, row_ended=True)
                outbox.append((sequence, ended))
            elif broken:
                if fresh and sequence.streams:  # its earlier outputs were sent: these now
                    sequence.emit(sequence.output(fresh, None, now, self._context.tracer))
                self._fail_non_finite(sequence)
            elif sequence.streams:
                outbox.append((sequence, sequence.output(fresh, None, now, self._context.tracer)))
        self._batch.changed()  # their tokens left: their slots' waits are simulated again

    def _fail_non_finite(self, sequence: GenerationSequence) -> None:
        """Its logits had no finite maximum (its model overflows its dtype): fail it (500),
        logged, rather than emit token 0 until its length; its slot's cache is zeroed."""
        generated = len(sequence.generated)
        if sequence.slot is not None:
            self._steps.clear_slot(sequence.slot)
        log.error(
            "%s: non-finite logits (NaN or inf) for request %s after %d generated tokens "
            "(%s): failing it; does the model overflow this dtype?",
            self.name,
            sequence.request.reference,
            generated,
            self.runner.dtype,
        )
        broke = f"generation failed: the model's logits were not finite after {generated} tokens"
        self._fail(sequence, FailureKind.FAILED, broke)

    def _finish(
        self,
        sequence: GenerationSequence,
        token_ids: list[int],
        reason: FinishReason,
        now: float,
        row_ended: bool = False,
    ) -> Output:
        """End the sequence (its slot is free from now) and return its final output
        (`row_ended`: as `_drop`'s)."""
        if (per_token := sequence.time_per_output_token()) is not None:
            self._context.metrics.time_per_output_token.labels(self.name).observe(per_token)
        sent = token_ids if sequence.streams else sequence.generated
        output = sequence.output(sent, reason, now, self._context.tracer)
        self._drop(sequence, row_ended)
        return output

    # --- gauges, reports, shutdown -----------------------------------------------------
    def refresh_gauges(self) -> None:
        generation_reports.refresh_gauges(self._context.metrics, self.name, self._batch)

    def debug_report(self) -> dict[str, object]:
        return generation_reports.debug_report(self.runner, self._batch, self._step_s)

    async def close(self) -> None:
        """Finish the running and waiting sequences, then stop the loop."""
        self._closing = True
        self._wakeup.set()
        if self._loop_task is not None:
            await self._loop_task
