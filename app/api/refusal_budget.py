"""Which refusals a front end answers without pausing the refused connection.

Pausing a refused connection (`api/shedding_protocol.py`) keeps a closed-loop flood, clients that
resend the moment they are refused, from turning a front end into a 429 machine. But it
also holds an open-loop client's next requests in the paused socket, where they age unseen
(docs/BENCHMARKS.md: at 3x capacity the admitted p99 went from 0.16 s to 6 s). The two
differ in volume, not in how one connection behaves: an open loop at 3x capacity asks for
two refusals per admission, a flood for as many as its connections can send.

So refusals are paid for by admissions: each admitted request earns `per_admission`
refusals answered at once (at most `BANKED_ADMISSIONS` admissions' worth banked); a
refusal with nothing to spend pauses its connection. A refusal costs the front end about a
tenth of an admission, so refusals answered at once stay a bounded share of its work
whatever the number of connections. With nothing admitted (engine down, draining) every
refusal pauses, as before.

Pure (no clock, no I/O); one instance per front-end process, used on its event loop thread.
"""

from __future__ import annotations

# How many admissions' worth of refusals can be banked: enough to ride out a batch's worth
# of refusals arriving together, small enough that a flood empties it within a few ms.
BANKED_ADMISSIONS = 64


class RefusalBudget:
    """One front end's earned refusals; `admitted` and `answer_at_once` are called from its
    HTTP protocol (`api/shedding_protocol.py`) for each request it decides on."""

    def __init__(self, per_admission: float, banked_admissions: int = BANKED_ADMISSIONS) -> None:
        self.per_admission = per_admission
        self.burst = per_admission * banked_admissions
        self._balance = 0.0  # nothing admitted yet, nothing earned

    def admitted(self) -> None:
        """A request was admitted: it earns `per_admission` refusals, up to `burst`."""
        self._balance = min(self.burst, self._balance + self.per_admission)

    def answer_at_once(self) -> bool:
        """A request is being refused: spend one refusal if one was earned (True: do not
        pause its connection); False: pause it."""
        if self._balance >= 1.0:
            self._balance -= 1.0
            return True
        return False
