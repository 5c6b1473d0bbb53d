"""Whether each front end of `steadyserve serve`'s tree still has a live event loop: what the
supervisor heard from it on its start pipe. Pure, on an injected clock.

A front end's event loop writes `HEARTBEAT` on its start pipe every `HEARTBEAT_INTERVAL_S`
once its start-up succeeded (`app/frontend_process.py::StartPipe`); a loop that blocks (a C
extension spinning, a deadlock) stops writing it, while the process lives and its socket
stays in the port's SO_REUSEPORT group: the kernel kept handing it its share of the new
connections, which sat in its backlog until their clients gave up, while the probe port said
ready. The supervisor (`app/processes.py`, its event loop thread) tells `FrontendHeartbeats`
what it hears, asks it which front ends are heartbeating (its `/readyz`) and kills one
silent for `SILENT_AFTER_S` (`overdue`), which is then restarted as any that died.
"""

from __future__ import annotations

from collections.abc import Callable

# How often a front end's event loop says it lives, once its start-up succeeded.
HEARTBEAT_INTERVAL_S = 0.5
# A front end that has said nothing for this long since its last heartbeat (or its start-up's
# success) has a hung event loop: it is killed and restarted. Busy is not hung: under a
# 5,000-connection flood on 2 cores, with other processes taking the CPU its nice leaves it,
# a front end's loop went 3.8 s without running its heartbeat's timer (2026-12-05, at a first
# limit of 3 s), and killing it, the tree's only front end, turned overload into refused
# connections. 30 s: the kubelet's liveness budget (10 s x 3 failures, deploy/k8s), which a
# loop that works does not reach; a hung one is killed 30 to 31 s after its last beat (the
# supervisor looks every second, `processes.CHECK_INTERVAL_S`), not left for ever.
SILENT_AFTER_S = 30.0


class FrontendHeartbeats:
    """Since when each front end serves and when it last said it lives, by its index in the
    tree. The supervisor's event loop thread only; every time is on `clock`."""

    def __init__(self, clock: Callable[[], float], silent_after_s: float = SILENT_AFTER_S) -> None:
        self._clock = clock
        self.silent_after_s = silent_after_s
        # When the supervisor heard each front end's start-up succeed; absent: not (yet).
        self._serving_since: dict[int, float] = {}
        # When it last heard from each front end that serves; absent: not serving, or
        # given up on (killed as hung: its late heartbeats are not heard).
        self._heard_at: dict[int, float] = {}
        self._spawned: set[int] = set()  # the front ends started at least once
        self._given_up: set[int] = set()  # those whose process now was killed as hung

    def replacing(self, index: int) -> str | None:
        """Why the process about to start as front end `index` replaces another (the
        `reason` of `steadyserve_frontend_restarts`): `hung` when the supervisor killed the
        last one for its silence (`give_up`), `died` otherwise; None for its first start."""
        if index not in self._spawned:
            return None
        return "hung" if index in self._given_up else "died"

    def spawned(self, index: int) -> None:
        """A new process is front end `index`: it serves once its start-up says so."""
        self._spawned.add(index)
        self._given_up.discard(index)
        self._serving_since.pop(index, None)
        self._heard_at.pop(index, None)

    def started(self, index: int) -> None:
        """Front end `index` said its start-up succeeded: it serves from now."""
        self._serving_since[index] = self._heard_at[index] = self._clock()

    def beat(self, index: int) -> None:
        """Front end `index` sent a heartbeat (ignored unless it serves and is not given up)."""
        if index in self._heard_at:
            self._heard_at[index] = self._clock()

    def give_up(self, index: int) -> None:
        """Front end `index` is being killed: no longer heartbeating, and never `overdue`
        again; since when it served still counts (its restart's backoff)."""
        self._heard_at.pop(index, None)
        self._given_up.add(index)

    def serving_since(self, index: int) -> float | None:
        return self._serving_since.get(index)

    def heartbeating(self, index: int) -> bool:
        """Whether front end `index` serves and was heard from within `silent_after_s`."""
        heard_at = self._heard_at.get(index)
        return heard_at is not None and self._clock() - heard_at <= self.silent_after_s

    def overdue(self, index: int) -> str | None:
        """Why front end `index` should be killed as hung (for the log); None while it
        should not: not yet serving (its start-up may take long, and it takes no connection
        until done), given up on, or heard from within `silent_after_s`."""
        heard_at = self._heard_at.get(index)
        if heard_at is None:
            return None
        silent_s = self._clock() - heard_at
        if silent_s <= self.silent_after_s:
            return None
        return f"has sent no heartbeat for {silent_s:.1f} s (its event loop is hung)"
