"""Running generation steps of one causal LM: each dispatch once a compute slot every model
shares is free, on a dispatcher compute thread (the prefill rows, whole prompts or chunks of
them, in one forward, the decode rows in another), and the warm-up shapes that precede
serving.

A dispatch is one step, or several decode steps in a row (multi-step decoding: each row's
chosen token is fed back on the compute thread, with no turn of the event loop between
steps; a row that chose EOS leaves the run, as it would leave the batch between single
steps). A serving dispatch hands each step's tokens to its `StepListener` on the event loop
thread as that step ends (`loop.call_soon_threadsafe`, so in order, and all before the
dispatch's task completes), while the compute thread goes on with the next step: the loop
takes a step's tokens and sends them while the next one computes, instead of the compute
thread waiting for the loop between steps. `interrupt` (any thread) ends a multi-step run
after its current step, as does another claimant joining the line for the compute slots
(`ComputeSlots.on_claim`); `sequence_waits` (any thread) makes a row's EOS end it, as a
sequence waiting when it started does.

A dispatch holds one shared compute slot from its start to its end, so embedding batches and
generation steps interleave without oversubscribing the CPU/GPU; a failed one's triage
(`generation_triage.py`) takes one again for its runs (`take_slot`, `rerun`, `release`).
A step that raises leaves its sampled rows' generators as they were before it (each
row's state is kept as the step starts, 1-3 us a row, and put back; the steps of a run
before it were handed over): a rerun draws what the failed step would have, so a seeded
request's tokens do not depend on a failure.
`StepRunner` is used on the engine's event loop thread; `_compute` runs on a compute thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from app.engine.generation_runs import HandOver, decode_run, drawing
from app.engine.host import EngineContext, ShapeDone
from app.engine.protocol import SamplingParams
from app.failures import device_lost
from app.models.causal_lm import CausalLMRunner, StepRow
from app.models.sampling import NO_TOKEN, new_generator

_GREEDY = SamplingParams(max_new_tokens=1)
# Weight of a newest single step in the step-time average admission predicts waits with.
STEP_TIME_SMOOTHING = 0.2


@dataclass(frozen=True, slots=True)
class StepResult:
    # Each row's chosen tokens, in the rows' order (EOS or NO_TOKEN ends a list); empty
    # lists when the dispatch handed its steps to a `StepListener` as they ended.
    tokens: list[list[int]]
    compute_s: float
    steps: int  # forwards run one after another (multi-step decoding: up to the steps asked)

    @property
    def step_s(self) -> float:
        return self.compute_s / max(self.steps, 1)

    def averaged_into(self, average_s: float) -> float:
        """The step-time average (`average_s`; 0: none yet) with this dispatch's steps, each
        weighed as if recorded alone (a run of 16 cheap decode steps weighed as much as a
        one-step prefill beside it, and the average sat near the prefill's)."""
        if average_s == 0:
            return self.step_s
        kept = (1 - STEP_TIME_SMOOTHING) ** max(self.steps, 1)
        return kept * average_s + (1 - kept) * self.step_s


class StepListener(Protocol):
    def __call__(self, slots: list[int], tokens: list[list[int]], continuing: bool) -> None:
        """One step of a dispatch ended (event loop thread): the rows it computed, by slot,
        and each one's chosen tokens (one; none for a prompt's non-final chunk; `NO_TOKEN`
        for broken logits); `continuing`: the compute thread runs the next step of the
        same dispatch now."""


class StepRunner:
    def __init__(
        self,
        runner: CausalLMRunner,
        context: EngineContext,
        wakeup: asyncio.Event,
        forget: Callable[[int], None] = lambda slot: None,
    ) -> None:
        """`wakeup` is set whenever a shared compute slot is given back (the host's);
        `forget(slot)` is told of each slot `clear_slot` zeroes (nothing there is resident:
        `SlotTable.forget`)."""
        self.runner = runner
        self._forget = forget
        self._context = context
        self.clock = context.clock  # the one requests' deadlines are on
        self._wakeup = wakeup
        # Charged on the compute thread as each serving dispatch ends, failed or not.
        self._busy = context.metrics.dispatcher_busy.labels(runner.name)
        self._interrupted = threading.Event()
        # Set while a sequence waits for a slot: a row choosing EOS ends the run (its slot
        # can be taken at once). Read on the compute thread after each step.
        self._end_on_eos = threading.Event()
        # Slots to zero before the next forward (`clear_slot`): appended on the loop thread
        # between steps, taken on the compute thread when the next step starts.
        self._slots_to_clear: list[int] = []
        # Steps the dispatch in flight has computed: written on the compute thread, read by
        # the host's forecast (`SequenceTable.hold`).
        self.run_steps = 0
        context.slots.on_claim(self.interrupt)  # another's turn ends a run (`start`)

    def interrupt(self) -> None:
        """End the multi-step run in flight after its current step (any thread): something
        can join the batch or leave it now."""
        self._interrupted.set()

    def clear_slot(self, slot: int) -> None:
        """Have `slot`'s cache zeroed on the compute thread before the next forward (event
        loop thread, between steps): its occupant's keys or values were not finite."""
        self._slots_to_clear.append(slot)
        self._forget(slot)

    def sequence_waits(self) -> None:
        """A sequence now waits for a slot (any thread): the multi-step run in flight ends
        after a step in which a row chooses EOS, freeing the slot it waits for."""
        self._end_on_eos.set()

    # --- warm-up ------------------------------------------------------------------------
    def _prefill_lengths(self) -> list[int]:
        """Each length bucket under the longest prompt row a step runs: a prompt's chunk
        (`generate_prefill_chunk_tokens`), at most the longest prompt."""
        longest = min(
            self.runner.max_sequence_tokens - 1,
            self._context.settings.generate_prefill_chunk_tokens,
        )
        lengths = [b for b in self._context.settings.length_buckets if b < longest]
        return [*lengths, longest]

    def _late_chunks(self) -> list[tuple[int, int]]:
        """The (start, length) of the longest prompt's chunks after its first (chunked
        prefill): each attends over the chunks before it, shapes the first chunk's lengths
        do not warm (its first chunk is `_prefill_lengths`' last)."""
        longest = self.runner.max_sequence_tokens - 1
        chunk = self._context.settings.generate_prefill_chunk_tokens
        return [(start, min(chunk, longest - start)) for start in range(chunk, longest, chunk)]

    def _decode_batches(self) -> list[int]:
        """Every batch size up to all slots on a CPU (oneDNN builds a matrix product's
        primitive per input shape: a decode step of a size warm-up skipped would pay 2-3 ms
        of set-up, `token_buckets.py`); 1, 2, 4, ... and all slots on CUDA, whose kernels
        are chosen per shape, not built."""
        slots = self.runner.cache.shape.slots
        if self.runner.device.type == "cpu":
            return list(range(1, slots + 1))
        sizes = [1 << i for i in range(slots.bit_length()) if 1 << i < slots]
        return [*sizes, slots]

    def _bucket_prefills(self) -> list[tuple[int, int]]:
        """(rows, tokens a row) of a prefill at each token bucket the direct decoder pads a
        prefill step to on a CPU (`CausalLMRunner.prefill_buckets`) that the single-row
        prefills before them do not reach: up to the largest step (`generate_max_batch_tokens`,
        rows of at most a chunk). None elsewhere."""
        settings = self._context.settings
        row_tokens = min(
            self.runner.max_sequence_tokens - 1, settings.generate_prefill_chunk_tokens
        )
        singles = [*self._prefill_lengths(), *(length for _, length in self._late_chunks())]
        warmed = {self.runner.linear_tokens(length) for length in singles}
        step_tokens = max(settings.generate_max_batch_tokens, row_tokens)
        return self.runner.prefill_buckets(row_tokens, step_tokens, warmed)

    @property
    def warmup_total(self) -> int:
        if not self._context.settings.warmup:
            return 0
        shapes = (
            self._prefill_lengths(),
            self._late_chunks(),
            self._bucket_prefills(),
            self._decode_batches(),
        )
        return sum(len(kind) for kind in shapes)

    async def warm_up(self, shape_done: ShapeDone) -> float:
        """Prefill one prompt of each length bucket, then the longest prompt's later chunks,
        then (CPU, direct decoder) a prefill at each token bucket the linears run on, then
        decode steps of every batch size up to all slots (CUDA: powers of two and all
        slots); returns the seconds of one more step with every slot decoding, run warm (the
        first run of a shape pays its set-up), the first step-time estimate."""
        total, done = self.warmup_total, 0
        filler = self.runner.pad_token_id
        for length in self._prefill_lengths():
            row = StepRow(0, [filler] * length, 0, _GREEDY, new_generator(0), prefill=True)
            await self.run([row])
            done += 1
            shape_done(done, total)
        longest = self.runner.max_sequence_tokens - 1
        for start, length in self._late_chunks():
            following = None if start + length >= longest else filler  # the last chooses
            fed = [filler] * length
            row = StepRow(
                0, fed, start, _GREEDY, new_generator(0), prefill=True, next_prompt_token=following
            )
            await self.run([row])
            done += 1
            shape_done(done, total)
        for rows, length in self._bucket_prefills():
            fed = [filler] * length
            await self.run(
                [StepRow(s, fed, 0, _GREEDY, new_generator(0), prefill=True) for s in range(rows)]
            )
            done += 1
            shape_done(done, total)
        step: list[StepRow] = []
        for rows in self._decode_batches():
            step = [StepRow(s, [filler], 1, _GREEDY, new_generator(0)) for s in range(rows)]
            await self.run(step)
            done += 1
            shape_done(done, total)
        return (await self.run(step)).step_s if step else 0.0

    # --- steps --------------------------------------------------------------------------
    async def run(self, rows: list[StepRow]) -> StepResult:
        """One step once a shared compute slot is free (warm-up)."""
        while not self._context.slots.available(self):
            await self._wakeup.wait()
            self._wakeup.clear()
        return await self.start(rows, metered=False)

    def start(
        self,
        rows: list[StepRow],
        steps: int = 1,
        end_on_eos: bool = False,
        metered: bool = True,
        listener: StepListener | None = None,
        each_step: frozenset[int] = frozenset(),
    ) -> asyncio.Task[StepResult]:
        """Take a shared compute slot (one must be free) and run one step on a compute thread, or
        with `steps` > 1 (decode rows only) up to that many decode steps in a row, fewer if
        every row chooses EOS (with `end_on_eos`, or once `sequence_waits` is called, any
        row: a sequence waits for the slot it frees) or `interrupt` is called or another
        claimant gets in line for a compute slot; the slot is given back when it ends, and
        health hears how it ended. With a `listener`, the step's tokens go to it (the
        result's lists are then empty): in a run, those of the rows in `each_step`'s slots
        as each step ends, the others' as the run ends or their row leaves it. `metered`
        (all but warm-up): its compute time is charged to the busy time, also when it fails;
        and health hears nothing of a metered step that raises: its caller triages it
        (`take_slot`, `rerun`), then tells health the verdict (`release`)."""
        if steps > 1 and any(row.prefill for row in rows):
            raise ValueError("only decode rows run several steps per dispatch")
        if steps > 1 and listener is None:
            raise ValueError("a multi-step run hands its steps to a listener")
        slots = self._context.slots
        slots.take(self)
        self.run_steps = 0
        if slots.line_waits():  # another waits for a slot: one step, then its turn
            self._interrupted.set()
        else:
            self._interrupted.clear()
        if end_on_eos:
            self._end_on_eos.set()
        else:
            self._end_on_eos.clear()
        hand_over = None
        if listener is not None:
            loop = asyncio.get_running_loop()

            def hand_over(slots: list[int], tokens: list[list[int]], continuing: bool) -> None:
                loop.call_soon_threadsafe(listener, slots, tokens, continuing)

        async def step() -> StepResult:
            failure: BaseException | None = None
            try:
                return await self._context.dispatcher.run_compute(
                    self._compute, rows, steps, metered, hand_over, each_step
                )
            except BaseException as error:
                failure = error
                raise
            finally:
                slots.give()
                # A failed step is told to health by its triage, once it is over; but a lost
                # device at once: its sequences' answer (`lost_device.step_failure`) names
                # this step's failure as the one that lost it, whatever another batch running
                # on the dead device meanwhile tells health.
                triaged = metered and isinstance(failure, Exception) and not device_lost(failure)
                if not (triaged or isinstance(failure, asyncio.CancelledError)):
                    self._context.record_batch(failure)

        return asyncio.create_task(step())

    async def take_slot(self) -> None:
        """Take a shared compute slot for a failed step's triage, in line as a step would
        (its runs: `rerun`; its end: `release`)."""
        slots = self._context.slots
        while not slots.available(self):
            slots.claim(self)
            await self._wakeup.wait()
            self._wakeup.clear()
        slots.take(self)

    async def rerun(self, rows: list[StepRow]) -> StepResult:
        """One step of some of a failed step's rows again, on the slot `take_slot` took, its
        compute charged to the busy time; health hears of it from `release`."""
        return await self._context.dispatcher.run_compute(self._compute, rows, 1, True)

    def release(self, failure: BaseException | None) -> None:
        """A failed step's triage is over: its compute slot back, and health told once, of
        what failed after the triage (None: it saw the server compute, and only prompts
        failed)."""
        self._context.slots.give()
        self._context.record_batch(failure)

    def _compute(
        self,
        rows: Sequence[StepRow],
        steps: int,
        metered: bool,
        hand_over: HandOver | None = None,
        each_step: frozenset[int] = frozenset(),
    ) -> StepResult:
        """Compute thread: the dispatch (`_forwards`), its time charged to the busy time as
        it ends, whether it returned or raised, when `metered`; a step that raises puts its
        sampled rows' generators back as they were before it (`generation_runs.drawing`)."""
        self._context.before_batch()
        started = time.perf_counter()
        try:
            return self._forwards(rows, steps, started, hand_over, each_step)
        finally:
            if metered:
                self._busy.inc(time.perf_counter() - started)

    def _count_step(self) -> None:
        """Compute thread: a step of the dispatch in flight ended (`run_steps`)."""
        self.run_steps += 1

    def _forwards(
        self,
        rows: Sequence[StepRow],
        steps: int,
        started: float,
        hand_over: HandOver | None,
        each_step: frozenset[int],
    ) -> StepResult:
        """Compute thread: the prefill rows (`StepRow.prefill`) in one forward, the decode
        rows in another; a prompt's non-final chunk gets no token (an empty list); with
        `steps` > 1, further decode steps on each row's chosen token (`decode_run`, which
        hands over `each_step`'s rows' tokens as each step ends). The tokens go to
        `hand_over`, when given, else into the result."""
        while self._slots_to_clear:
            self.runner.cache.clear_slot(self._slots_to_clear.pop())
        if steps > 1 and hand_over is not None:  # `start` sees to it
            forwards = decode_run(
                self.runner,
                rows,
                steps,
                hand_over,
                each_step,
                self._interrupted,
                self._end_on_eos,
                self._count_step,
            )
            return StepResult([[] for _ in rows], time.perf_counter() - started, forwards)
        prefill = [row for row in rows if row.prefill]  # prompts and chunks of them
        # In slot order: consecutive slots read the cache as a view instead of a copy.
        decode = sorted((row for row in rows if not row.prefill), key=lambda row: row.slot)
        single: dict[int, list[int]] = {}
        put_back = drawing(rows)
        try:
            for group in (prefill, decode):
                if group:
                    for row, token in zip(group, self.runner.step(group), strict=True):
                        # A prompt's non-final chunk chooses no token (`StepRow.chooses`),
                        # unless its logits broke (NO_TOKEN).
                        single[row.slot] = [token] if row.chooses or token == NO_TOKEN else []
        except BaseException:
            put_back()
            raise
        tokens = [single[row.slot] for row in rows]
        if hand_over is not None:
            hand_over([row.slot for row in rows], tokens, False)
            tokens = [[] for _ in rows]
        return StepResult(tokens, time.perf_counter() - started, 1)
