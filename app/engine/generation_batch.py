"""Where each sequence of one generate model is: waiting for a KV-cache slot (oldest first)
or running in one, and which waiting sequences join the next step. The host
(`generation_host.py`) decides when; this keeps the membership and the slots consistent.

Event loop thread only.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Set

from app.engine.generation_sequences import GenerationSequence
from app.engine.kv_slots import steps_until_start
from app.engine.slot_table import SlotTable
from app.model_queues import ModelWork


class SequenceTable:
    def __init__(
        self, slots: int, reuse: bool = False, steps_run: Callable[[], int] = lambda: 0
    ) -> None:
        """`steps_run()`: the steps the dispatch in flight has computed (written on the
        compute thread, `StepRunner.run_steps`), which `hold` counts for its rows."""
        self.slots = SlotTable(slots, reuse)
        self.waiting: deque[GenerationSequence] = deque()
        self.running: dict[int, GenerationSequence] = {}  # by slot
        # `_forecast`'s steps, simulated once per change (`changed`): every admission of
        # any model and every status (each 5 ms) read them, a heap over the running
        # sequences and a push and pop for each of up to `generate_max_waiting` waiting.
        self._steps: tuple[int, int] | None = None
        # The running sequences whose tokens the run in flight holds on the compute thread
        # (`hold`), and its steps as last forecast with.
        self._steps_run = steps_run
        self._held: Set[GenerationSequence] = frozenset()
        self._forecast_held_steps = 0

    def hold(self, held: Set[GenerationSequence]) -> None:
        """`held` (running) get their tokens of the run in flight only as it ends: the
        forecast counts the steps it has computed (`steps_run`) as taken for them (from the
        tokens taken alone, a row's steps left were overstated by up to a run's, and so a
        new sequence's wait for a slot). `hold(frozenset())` once its tokens were taken."""
        self._held = held
        self.changed()

    def changed(self) -> None:
        """Its sequences moved: one queued, joined or left, or a step's tokens were
        taken (the host calls this at each step's end); `_forecast` simulates again."""
        self._steps = None

    def queue(self, sequence: GenerationSequence) -> None:
        """A new sequence waits for a slot, after those waiting already."""
        self.waiting.append(sequence)
        self.changed()

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)

    def everyone(self) -> list[GenerationSequence]:
        return [*self.waiting, *self.running.values()]

    def is_running(self, sequence: GenerationSequence) -> bool:
        """The sequence holds its slot still (not cancelled, expired or finished since)."""
        return sequence.slot is not None and self.running.get(sequence.slot) is sequence

    def remove(self, sequence: GenerationSequence) -> bool:
        """Forget the sequence wherever it is; True when it gave a slot back."""
        self.changed()
        if sequence.slot is None:
            with contextlib.suppress(ValueError):
                self.waiting.remove(sequence)
            return False
        if not self.is_running(sequence):
            return False
        del self.running[sequence.slot]
        self.slots.give(sequence.slot, sequence.resident())
        return True

    def join(self, max_batch_tokens: int, now: float) -> list[GenerationSequence]:
        """Waiting sequences that take free slots for the next step, oldest first, while the
        step's prompt rows (rows x longest chunk: those still prefilling, then the joiners'
        first chunks, past the prompt tokens each reuses) fit `max_batch_tokens`; the first
        prompt row always runs. A joiner takes the slot `SlotTable.choose` picks for its
        prompt, `prefilled` the tokens it reuses there."""
        joiners: list[GenerationSequence] = []
        prefilling = [s.next_chunk() for s in self.running.values() if s.prefilling]
        rows, longest = len(prefilling), max(prefilling, default=0)
        while self.waiting and self.slots.free > 0:
            candidate = self.waiting[0]
            slot, reused = self.slots.choose(candidate.prompt, candidate.sampling)
            chunk = min(candidate.chunk_tokens, len(candidate.prompt) - reused)
            longer = max(longest, chunk)
            if rows and longer * (rows + 1) > max_batch_tokens:
                break
            self.waiting.popleft()
            candidate.slot = self.slots.take(slot)
            candidate.prefilled = candidate.reused = reused
            candidate.started = now
            self.running[candidate.slot] = candidate
            joiners.append(candidate)
            rows, longest = rows + 1, longer
        if joiners:
            self.changed()
        return joiners

    def steps_until_a_slot(self) -> int:
        """Predicted steps before a sequence queued now gets a slot."""
        return self._forecast()[0]

    def _forecast(self) -> tuple[int, int]:
        """Steps before a sequence queued now gets a slot (`steps_until_start`), and before
        every sequence could end: the longest running one's remaining steps, or the last
        waiting one's, started once a slot frees (no later than one queued now). A
        sequence's steps are its tokens left and its prefill's extra chunks (`steps_left`),
        less the steps a run holding its tokens computed (`hold`). Simulated once after each
        change (`changed`) or step of such a run."""
        run = self._steps_run() if self._held else 0
        if self._steps is None or run != self._forecast_held_steps:
            self._forecast_held_steps = run
            running = [
                max(seq.steps_left() - (run if seq in self._held else 0), 0)
                for seq in self.running.values()
            ]
            waiting = [seq.steps_left() for seq in self.waiting]
            until_a_slot = steps_until_start(running, self.slots.free, waiting)
            steps = max(running, default=0)
            if waiting:
                steps = max(steps, until_a_slot + max(waiting))
            self._steps = (until_a_slot, steps)
        return self._steps

    def at_cap(self, max_waiting: int) -> bool:
        """Whether a new sequence is refused whatever its wait: `max_waiting` wait for a
        slot already, and no slot is free for another."""
        waiting = len(self.waiting)
        return waiting >= max_waiting and self.slots.free <= waiting

    def work(self, step_s: float, max_waiting: int) -> ModelWork:
        """Its work on the compute slots: a step a turn while it has sequences (another
        model in line ends a multi-step run after its current step: `ComputeSlots.on_claim`),
        for as many turns as they take at most: until the longest running one ends, or the
        last waiting one does, started once a slot frees for it (no later than one queued
        now). A sequence queued now waits for a slot (`own_wait_s`: steps of `step_s`, which
        no other model waits for), every step until then a turn of each other model
        (`batches_ahead`)."""
        if not self:
            return ModelWork(0.0, 0.0, 0.0, turns=0)
        until_a_slot, steps = self._forecast()
        return ModelWork(
            running_s=0.0,
            queued_s=0.0,
            next_batch_s=step_s,
            batches_ahead=until_a_slot,
            turns=steps,
            own_wait_s=until_a_slot * step_s,
            at_cap=self.at_cap(max_waiting),
        )
