"""A failed generation step, blamed narrowly: which of its sequences failed it.

A step runs the joiners' prefill (whole prompts, or a chunk of a long one: chunked prefill)
and the other sequences' decode in one dispatch (`generation_steps.py`), so one prompt the
model throws on, or an out-of-memory while prefilling one long prompt, failed every sequence
of the step, and the step counted toward the engine's ill health. So a failed step is
triaged (`batch_triage.triage`, the embedding path's): its decode rows run again without the
joiners, as its known-good row (they computed the step before; their keys and values are
intact, as a prefill writes the joiners' slots alone, and a decode step rewrites the
positions it writes), then each joiner's prefill alone, shortest chunk first. A joiner that
fails alone is its prompt's fault once the server was seen computing (400, its slot zeroed);
the rest get their tokens as from the step. Out of memory is retried this way too (each run
needs less than the step: `alone_after_allocation_failure`), a prompt that runs out alone
failing as the server's (500), as do the longer ones after it; a lost device
(`failures.device_lost`) is not retried: every sequence fails as `lost_device.step_failure`
answers it (500 `device_lost`). When even the decode rows fail, the server is failing: every
sequence fails (500), none run again.

The triage takes a compute slot in turn, as the next step would, and holds it for its runs
(`StepRunner.take_slot`, `rerun`); health hears of the step once, after it
(`StepRunner.release`): of what failed the server's way, or, when only prompts were at
fault, of a success. A sequence past its deadline, cancelled or gone is not run again: the
step loop expires it (504) or lets it join the next step. A sampled sequence's retried step
draws what the failed one would have (a step that raises puts its generators back as it
found them: `generation_runs.drawing`), so a seeded request gives the tokens it gives
without the failure.
Event loop thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from app.batch_triage import RowFailed, triage
from app.engine.generation_batch import SequenceTable
from app.engine.generation_sequences import GenerationSequence
from app.engine.generation_steps import StepResult, StepRunner
from app.engine.host import EngineContext
from app.engine.lost_device import step_failure
from app.engine.protocol import Failure, FailureKind
from app.failures import device_lost

log = logging.getLogger(__name__)

Fail = Callable[[GenerationSequence, Failure], None]
Advance = Callable[[list[GenerationSequence], list[list[int]]], None]


class StepTriage:
    """`fail(sequence, failure)` fails one sequence and frees its slot; `advance(sequences,
    tokens)` gives sequences their tokens, as after a step (the host's); `context` tells a
    lost device's answer (`lost_device.step_failure`)."""

    def __init__(
        self,
        steps: StepRunner,
        batch: SequenceTable,
        fail: Fail,
        advance: Advance,
        context: EngineContext,
    ) -> None:
        self._steps = steps
        self._context = context
        self._batch = batch
        self._clock = steps.clock
        self._fail = fail
        self._advance = advance
        self._name = steps.runner.name

    async def answer(self, sequences: list[GenerationSequence], error: Exception) -> None:
        """Answer the sequences of a step that raised `error` from narrower runs, on a
        compute slot taken in turn, then give the slot back, telling health the verdict. A
        fault of the triage itself fails the sequences it left (500) and is what health
        hears."""
        if device_lost(error):  # never run again; health heard of it from the step itself
            for sequence in sequences:
                self._fail_servers(sequence, error)
            return
        await self._steps.take_slot()
        failure: BaseException | None = error
        try:
            failure = await self._triage(sequences, error)
        except Exception as fault:
            log.exception("%s: triage of a failed generation step failed", self._name)
            failure = fault
            for sequence in sequences:
                self._fail_servers(sequence, fault)
        finally:
            self._steps.release(failure)

    def _waits(self, sequence: GenerationSequence) -> bool:
        """Still worth a run: it holds its slot and its deadline has not passed."""
        return self._batch.is_running(sequence) and sequence.request.deadline > self._clock()

    async def _triage(
        self, sequences: list[GenerationSequence], error: Exception
    ) -> Exception | None:
        # Prompt rows (a whole prompt or a chunk of one) are the joiners; a chunk's rerun
        # rewrites the positions the failed step wrote.
        decoders = [s for s in sequences if not s.prefilling and self._waits(s)]
        joiners = sorted(
            (s for s in sequences if s.prefilling and self._batch.is_running(s)),
            key=lambda s: s.next_chunk(),
        )
        for sequence in sequences:  # the failed prefill may have left anything in its slot,
            # also one cancelled meanwhile: zeroed before reuse. A later chunk's slot holds
            # its earlier chunks, which its rerun reads: zeroed only if it no longer runs.
            if sequence.prefilling and (sequence.prefilled == 0 or not self._waits(sequence)):
                self._clear(sequence)
        for sequence in sequences:  # a failed step's slots hold nothing reusable
            if sequence.slot is not None:  # (`SlotTable.forget`), also a free one's
                self._batch.slots.forget(sequence.slot)
        tokens: dict[GenerationSequence, list[int]] = {}

        async def run(group: Sequence[GenerationSequence]) -> StepResult:
            result = await self._steps.rerun([sequence.row() for sequence in group])
            tokens.update(zip(group, result.tokens, strict=True))
            return result

        verdict = await triage(
            joiners,
            error,
            run,
            decoders or None,
            still_waiting=lambda index: self._waits(joiners[index]),
            alone_after_allocation_failure=True,
        )
        computed = [s for s in sequences if s in tokens]
        self._advance(computed, [tokens[s] for s in computed])
        for joiner, alone in zip(joiners, verdict.alone, strict=True):
            if isinstance(alone, RowFailed):
                self._fail_joiner(joiner, alone)
        for decoder in decoders:
            if decoder not in tokens:  # its known-good run failed: the server's
                self._fail_servers(decoder, verdict.server_error or error)
        for sequence in joiners:  # a later chunk not run again (gone or past its deadline:
            if sequence.prefilled > 0 and sequence not in tokens:  # it fails next turn)
                self._clear(sequence)
        return verdict.server_error

    def _clear(self, sequence: GenerationSequence) -> None:
        if sequence.slot is not None:
            self._steps.clear_slot(sequence.slot)

    def _fail_servers(self, sequence: GenerationSequence, error: BaseException) -> None:
        """500, or a lost device's answer (`lost_device.step_failure`: sent before health
        hears of the loss, which exits the engine once it is answered)."""
        if self._batch.is_running(sequence):
            self._clear(sequence)
            self._fail(sequence, step_failure(sequence.request, error, self._context))

    def _fail_joiner(self, sequence: GenerationSequence, failed: RowFailed) -> None:
        """Fail a joiner as triage found it: 500 when the server's, else 400 naming the class
        of what the model raised (its text, which may hold anything, only in this log)."""
        if failed.servers:
            self._fail_servers(sequence, failed.error)
            return
        if not self._batch.is_running(sequence):
            return
        request = sequence.request
        log.warning(
            "%s: the model failed on the prompt of request %s alone",
            self._name,
            request.reference,
            exc_info=failed.error,
        )
        self._clear(sequence)
        message = (
            f"the model could not process the prompt ({type(failed.error).__name__}); "
            f"the server logged why under request {request.reference}"
        )
        self._fail(sequence, Failure(request.request_id, FailureKind.BAD_REQUEST, message))
