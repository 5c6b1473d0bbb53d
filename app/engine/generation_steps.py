"""Running generation steps of one causal LM: each dispatch once a compute slot every model
shares is free, on a dispatcher compute thread (the prefill rows, whole prompts or chunks of
them, in one forward, the decode rows in another), and the warm-up shapes that precede
serving.

A dispatch is one step, or several decode steps in a row (multi-step decoding: each row's
chosen token is fed back on the compute thread, with no turn of the event loop between
steps; a row that chose EOS leaves the run, as it would leave the batch between single
steps). `interrupt` (any thread) ends a multi-step run after its current step;
`sequence_waits` (any thread) makes a row's EOS end it, as a sequence waiting when it started
does.

A dispatch holds one shared compute slot from its start to its end, so embedding batches and
generation steps interleave without oversubscribing the CPU/GPU; a failed one's triage
(`generation_triage.py`) takes one again for its runs (`take_slot`, `rerun`, `release`).
A dispatch that raises leaves its sampled rows' generators as they were before it (each
row's state is kept as it starts, 1-3 us a row, and put back): a rerun draws what the
failed dispatch would have, so a seeded request's tokens do not depend on a failure.
`StepRunner` is used on the engine's event loop thread; `_compute` runs on a compute thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.engine.host import EngineContext, ShapeDone
from app.engine.protocol import SamplingParams
from app.failures import device_lost
from app.models.causal_lm import CausalLMRunner, StepRow
from app.models.sampling import NO_TOKEN, new_generator

_GREEDY = SamplingParams(max_new_tokens=1)


@dataclass(frozen=True, slots=True)
class StepResult:
    # Each row's chosen tokens, in the rows' order (EOS or NO_TOKEN ends a list).
    tokens: list[list[int]]
    compute_s: float
    steps: int  # forwards run one after another (multi-step decoding: up to the steps asked)

    @property
    def step_s(self) -> float:
        return self.compute_s / max(self.steps, 1)


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
        slots = self.runner.cache.shape.slots
        sizes = [1 << i for i in range(slots.bit_length()) if 1 << i < slots]
        return [*sizes, slots]

    @property
    def warmup_total(self) -> int:
        if not self._context.settings.warmup:
            return 0
        shapes = self._prefill_lengths(), self._late_chunks(), self._decode_batches()
        return sum(len(kind) for kind in shapes)

    async def warm_up(self, shape_done: ShapeDone) -> float:
        """Prefill one prompt of each length bucket, then the longest prompt's later chunks,
        then decode steps of every batch size up to all slots; returns the seconds of one
        more step with every slot decoding, run warm (the first run of a shape pays its
        set-up), the first step-time estimate."""
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
        self, rows: list[StepRow], steps: int = 1, end_on_eos: bool = False, metered: bool = True
    ) -> asyncio.Task[StepResult]:
        """Take a shared compute slot (one must be free) and run one step on a compute
        thread, or with `steps` > 1 (decode rows only) up to that many decode steps in a row,
        fewer if every row chooses EOS (with `end_on_eos`, or once `sequence_waits` is called,
        any row: a sequence waits for the slot it frees) or `interrupt` is called; the slot is
        given back when it ends, and health hears how it ended. `metered` (all but warm-up):
        its compute time is charged to the busy time, also when it fails; and health hears
        nothing of a metered step that raises: its caller triages it (`take_slot`, `rerun`),
        then tells health the verdict (`release`)."""
        if steps > 1 and any(row.prefill for row in rows):
            raise ValueError("only decode rows run several steps per dispatch")
        slots = self._context.slots
        slots.take(self)
        self._interrupted.clear()
        if end_on_eos:
            self._end_on_eos.set()
        else:
            self._end_on_eos.clear()

        async def step() -> StepResult:
            failure: BaseException | None = None
            try:
                return await self._context.dispatcher.run_compute(
                    self._compute, rows, steps, metered
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

    def _compute(self, rows: Sequence[StepRow], steps: int, metered: bool) -> StepResult:
        """Compute thread: the dispatch (`_forwards`), its time charged to the busy time as
        it ends, whether it returned or raised, when `metered`; one that raises puts its
        sampled rows' generators back as they were before it."""
        self._context.before_batch()
        started = time.perf_counter()
        # Each sampled row's generator as it was (greedy rows draw nothing): a rerun of this
        # dispatch's rows must draw as it would have, else a seeded sample depends on a failure.
        drawn = [
            (row.generator, row.generator.get_state()) for row in rows if row.sampling.do_sample
        ]
        try:
            return self._forwards(rows, steps, started)
        except BaseException:
            for generator, state in drawn:
                generator.set_state(state)
            raise
        finally:
            if metered:
                self._busy.inc(time.perf_counter() - started)

    def _forwards(self, rows: Sequence[StepRow], steps: int, started: float) -> StepResult:
        """Compute thread: the prefill rows (`StepRow.prefill`) in one forward, the decode
        rows in another; a prompt's non-final chunk gets no token (an empty list); with
        `steps` > 1, further decode steps on each row's chosen token."""
        while self._slots_to_clear:
            self.runner.cache.clear_slot(self._slots_to_clear.pop())
        if steps > 1:
            chosen = self._decode_run(rows, steps)
            forwards = max((len(tokens) for tokens in chosen.values()), default=0)
            return StepResult(
                [chosen[row.slot] for row in rows], time.perf_counter() - started, forwards
            )
        prefill = [row for row in rows if row.prefill]  # prompts and chunks of them
        # In slot order: consecutive slots read the cache as a view instead of a copy.
        decode = sorted((row for row in rows if not row.prefill), key=lambda row: row.slot)
        single: dict[int, list[int]] = {}
        for group in (prefill, decode):
            if group:
                for row, token in zip(group, self.runner.step(group), strict=True):
                    # A prompt's non-final chunk chooses no token (`StepRow.chooses`).
                    # A non-final chunk has no token, unless its logits broke (NO_TOKEN).
                    single[row.slot] = [token] if row.chooses or token == NO_TOKEN else []
        return StepResult([single[row.slot] for row in rows], time.perf_counter() - started, 1)

    def _decode_run(self, rows: Sequence[StepRow], steps: int) -> dict[int, list[int]]:
        """Up to `steps` decode steps, each feeding every row the token it just chose (the
        same rows, positions and generator draws as single steps); a row that chose EOS or
        one of its `stop_token_ids` (or got `NO_TOKEN`: its logits broke down) stops, as
        does the run when `interrupt` is called, or, while a sequence waits for a slot
        (`end_on_eos`, `sequence_waits`), after the step in which any row chose EOS.
        Each row's tokens, by slot."""
        eos = self.runner.eos_token_ids
        active = sorted(rows, key=lambda row: row.slot)  # slot order: see `_compute`
        chosen: dict[int, list[int]] = {row.slot: [] for row in rows}
        for step in range(steps):
            if step and self._interrupted.is_set():
                break
            following: list[StepRow] = []
            for row, token in zip(active, self.runner.step(active), strict=True):
                chosen[row.slot].append(token)
                ends = token in eos or token in row.sampling.stop_token_ids
                if not ends and token != NO_TOKEN:
                    following.append(
                        StepRow(
                            row.slot,
                            (token,),
                            row.start + 1,
                            row.sampling,
                            row.generator,
                            row.logprobs,
                        )
                    )
            if not following or (len(following) < len(active) and self._end_on_eos.is_set()):
                break
            active = following
        return chosen
