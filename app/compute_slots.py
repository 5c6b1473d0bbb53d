"""The compute slots every host of the engine shares: how many batches (or generation
steps) may run at once, one per dispatcher compute thread, handed out in turn.

Whoever finds work ready and no slot free `claim`s one and joins the line; a slot given
back is kept for the head of the line. Without the line the slot went to whichever host's
loop happened to resume first after `give` woke them all: a generation loop (resumed one
callback after its step) took it back every step while an embedding batch waited out the
whole generation, and the first-registered batcher kept it while its queue was never
empty, expiring the inputs of every other model behind it (measured in a simulation:
a one-row embedding answered 0.7 s late, after a 300-step generation). Event loop thread
only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable


class ComputeSlots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._line: list[Hashable] = []  # claimants waiting for a slot, first come first
        self._listeners: list[asyncio.Event] = []
        self._claim_listeners: list[Callable[[], None]] = []

    def listen(self, wakeup: asyncio.Event) -> None:
        """`wakeup` is set whenever a slot is given back or the line moves."""
        self._listeners.append(wakeup)

    def on_claim(self, callback: Callable[[], None]) -> None:
        """`callback()` is called whenever a claimant gets in line: whoever holds a slot
        for a run of several steps (`generation_steps.py`) ends it after its current step,
        so the line waits for one step, not a whole run."""
        self._claim_listeners.append(callback)

    def line_waits(self) -> bool:
        """Whether a claimant is in line: whoever takes a slot now for a run of several
        steps ends it after its first (`on_claim` told it of no one already in line)."""
        return bool(self._line)

    def available(self, claimant: Hashable) -> bool:
        """Whether `claimant` may take a slot now: one is free for each claimant ahead of
        it in the line, and one more for it."""
        ahead = self._line.index(claimant) if claimant in self._line else len(self._line)
        return ahead < self.free

    def claim(self, claimant: Hashable) -> None:
        """`claimant` has work ready and no slot: it is next after those already waiting."""
        if claimant not in self._line:
            self._line.append(claimant)
            for callback in self._claim_listeners:
                callback()

    def withdraw(self, claimant: Hashable) -> None:
        """`claimant` has nothing ready any more (its inputs expired or were cancelled, its
        loop stopped): the line moves on without it."""
        if claimant in self._line:
            self._line.remove(claimant)
            self._wake()

    def stand(self, claimant: Hashable, *, waiting: bool) -> None:
        """After a turn in which `claimant` took no slot: in line while it has work ready
        and none was free for it (`waiting`), else out of the line."""
        if waiting:
            self.claim(claimant)
        else:
            self.withdraw(claimant)

    def take(self, claimant: Hashable) -> None:
        if not self.available(claimant):
            raise RuntimeError("no compute slot is free for this claimant")
        if claimant in self._line:
            self._line.remove(claimant)
        self.free -= 1

    def give(self) -> None:
        self.free += 1
        self._wake()

    def _wake(self) -> None:
        for wakeup in self._listeners:
            wakeup.set()
