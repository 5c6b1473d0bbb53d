"""Taking a generation dispatch's steps as the compute thread hands them over
(`StepRunner.start`'s listener), for one generate model's host.

Within a multi-step run, a step's tokens are taken at once (`advance`), then `between_steps`
(the outputs sent, deadlines checked but for the sequences whose tokens the compute thread
still holds) while the compute thread runs the next step. The
dispatch's last step is kept for the host's loop to take once the dispatch is over
(`take_last`), in the turn that starts the next dispatch and then sends the outputs, so no
cancel or failure handled in between comes between an output made and sent. A failure while
taking a step ends the run (`interrupt`) and is raised by the loop (`raise_failure`), as if
the loop itself had failed, instead of being lost in a callback with its sequences
unanswered. Event loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable

from app.engine.generation_sequences import GenerationSequence
from app.engine.generation_steps import StepListener

Advance = Callable[[list[GenerationSequence], list[list[int]]], None]


class StepHandOver:
    def __init__(
        self,
        advance: Advance,
        between_steps: Callable[[set[GenerationSequence]], None],
        interrupt: Callable[[], None],
    ) -> None:
        """`between_steps(held)` runs after a step taken within a run; `held`: the run's
        sequences whose tokens the compute thread holds until the run ends (those that do
        not stream), which must not be ended meanwhile on what was taken so far."""
        self._advance = advance
        self._between_steps = between_steps
        self._interrupt = interrupt
        self._failure: Exception | None = None
        self._last: tuple[list[GenerationSequence], list[list[int]]] | None = None

    def listener(
        self, sequences: list[GenerationSequence], held: frozenset[GenerationSequence]
    ) -> StepListener:
        """The listener of a dispatch of `sequences` (each in its slot), of which `held`
        get their tokens as the run ends or their row leaves it, the others each step
        (`StepRunner.start`'s `each_step`)."""
        by_slot = {sequence.slot: sequence for sequence in sequences}
        pending = set(held)  # less each one handed over as its row left the run

        def took(slots: list[int], tokens: list[list[int]], continuing: bool) -> None:
            stepped = [by_slot[slot] for slot in slots]
            if not continuing:
                self._last = (stepped, tokens)
                return
            if self._failure is not None:  # the run ends: its loop raises it
                return
            try:
                self._advance(stepped, tokens)
                pending.difference_update(stepped)
                self._between_steps(pending)
            except Exception as failure:
                self._failure = failure
                self._interrupt()

        return took

    def take_last(self) -> None:
        """Take the dispatch's last step (after a failed run: the steps computed before
        its failure that were not taken yet)."""
        last, self._last = self._last, None
        if last is not None:
            self._advance(*last)

    def raise_failure(self) -> None:
        """Raise what failed while taking a step of the dispatch, if anything did."""
        failure, self._failure = self._failure, None
        if failure is not None:
            self._last = None
            raise failure
