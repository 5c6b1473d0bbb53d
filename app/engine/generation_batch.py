"""Where each sequence of one generate model is: waiting for a KV-cache slot (oldest first)
or running in one, and which waiting sequences join the next step. The host
(`generation_host.py`) decides when; this keeps the membership and the slots consistent.

Event loop thread only.
"""

from __future__ import annotations

import contextlib
from collections import deque

from app.engine.generation_sequences import GenerationSequence
from app.engine.kv_slots import SlotTable, steps_until_start
from app.model_queues import ModelWork


class SequenceTable:
    def __init__(self, slots: int) -> None:
        self.slots = SlotTable(slots)
        self.waiting: deque[GenerationSequence] = deque()
        self.running: dict[int, GenerationSequence] = {}  # by slot

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)

    def everyone(self) -> list[GenerationSequence]:
        return [*self.waiting, *self.running.values()]

    def is_running(self, sequence: GenerationSequence) -> bool:
        """The sequence holds its slot still (not cancelled, expired or finished since)."""
        return sequence.slot is not None and self.running.get(sequence.slot) is sequence

    def remove(self, sequence: GenerationSequence) -> bool:
        """Forget the sequence wherever it is; True when it gave a slot back."""
        if sequence.slot is None:
            with contextlib.suppress(ValueError):
                self.waiting.remove(sequence)
            return False
        if not self.is_running(sequence):
            return False
        del self.running[sequence.slot]
        self.slots.give(sequence.slot)
        return True

    def join(self, max_batch_tokens: int, now: float) -> list[GenerationSequence]:
        """Waiting sequences that take free slots for the next step, oldest first, while the
        prefill (rows x longest prompt) fits `max_batch_tokens`."""
        joiners: list[GenerationSequence] = []
        longest = 0
        while self.waiting and self.slots.free > 0:
            candidate = self.waiting[0]
            longer = max(longest, len(candidate.prompt))
            if joiners and longer * (len(joiners) + 1) > max_batch_tokens:
                break
            self.waiting.popleft()
            candidate.slot = self.slots.take()
            candidate.started = now
            self.running[candidate.slot] = candidate
            joiners.append(candidate)
            longest = longer
        return joiners

    def steps_until_a_slot(self) -> int:
        """Predicted steps before a sequence queued now gets a slot."""
        running = (seq.remaining for seq in self.running.values())
        waiting = (seq.sampling.max_new_tokens for seq in self.waiting)
        return steps_until_start(running, self.slots.free, waiting)

    def at_cap(self, max_waiting: int) -> bool:
        """Whether a new sequence is refused whatever its wait: `max_waiting` wait for a
        slot already, and no slot is free for another."""
        waiting = len(self.waiting)
        return waiting >= max_waiting and self.slots.free <= waiting

    def work(self, step_s: float, steps_per_dispatch: int, max_waiting: int) -> ModelWork:
        """Its work on the compute slots: a dispatch of `steps_per_dispatch` steps a turn (a
        slot is held a dispatch at a time) while it has sequences, for as many turns as they
        take at most: until the longest running one ends, or the last waiting one does,
        started once a slot frees for it (no later than one queued now). A sequence queued
        now waits for a slot (`own_wait_s`: steps of `step_s`, which no other model waits
        for), every dispatch until then a turn of each other model (`batches_ahead`)."""
        if not self:
            return ModelWork(0.0, 0.0, 0.0, turns=0)
        until_a_slot = self.steps_until_a_slot()
        steps = max((seq.remaining for seq in self.running.values()), default=0)
        if self.waiting:
            steps = max(steps, until_a_slot + max(seq.remaining for seq in self.waiting))
        return ModelWork(
            running_s=0.0,
            queued_s=0.0,
            next_batch_s=step_s * steps_per_dispatch,
            batches_ahead=-(-until_a_slot // steps_per_dispatch),
            turns=-(-steps // steps_per_dispatch),
            own_wait_s=until_a_slot * step_s,
            at_cap=self.at_cap(max_waiting),
        )
