"""When `steadyserve serve`'s tree is crash-looping: a pod problem its supervisor's /healthz
reports (`ProcessTree._answer_probe`), so that Kubernetes restarts the pod, and its exit
status says.

A child that keeps dying is restarted with backoff for ever; while it does, /readyz stays
503 and, without this, /healthz 200: the pod was never restarted. One rule for both kinds
(`crash_loop`): `RESTARTS_BEFORE_UNHEALTHY` restarts in a row without the child getting
anywhere. The engine's count is its restarts since one was last heard ready
(`EngineSupervisor.restarts_since_ready`); a front end's, its restarts since one served for
`STABLE_AFTER_S` (`FrontendCrashLoops`: one killed as hung had started, so "started" alone
would never count it), and the pod's problem only once every front end loops (while one
serves, the pod does too). The supervisor's event loop thread only; pure, on its clock.
"""

from __future__ import annotations

from collections.abc import Callable

from app.engine.supervisor import STABLE_AFTER_S
from app.frontend_heartbeats import FrontendHeartbeats

# Restarts in a row, without the child getting anywhere, before the supervisor's /healthz
# says the pod should be restarted: a child that crash-loops (a model that cannot load, a
# device that fails, a front end whose start-up fails or whose loop keeps hanging) would
# otherwise leave it NotReady forever, live in Kubernetes' eyes.
RESTARTS_BEFORE_UNHEALTHY = 5


def crash_loop(restarts: int, who: str, without: str) -> str | None:
    """Why the pod should be restarted, once `who` restarted `RESTARTS_BEFORE_UNHEALTHY`
    times `without` (what it never did in between); None before."""
    if restarts < RESTARTS_BEFORE_UNHEALTHY:
        return None
    return f"{who} restarted {restarts} times without {without}"


class FrontendCrashLoops:
    """Each front end's restarts since it last served for `STABLE_AFTER_S`, by its index,
    from when `heartbeats` heard it start serving."""

    def __init__(self, heartbeats: FrontendHeartbeats, clock: Callable[[], float]) -> None:
        self._heartbeats = heartbeats
        self._clock = clock
        self._unstable: dict[int, int] = {}
        # Since when the last process counted dead (`died`) had served, by index: until its
        # replacement says it serves, what `heartbeats` says of front end `index` is its.
        self._died_serving_since: dict[int, float | None] = {}

    def served_stable(self, index: int) -> bool:
        """Whether front end `index` has served for `STABLE_AFTER_S`: counted from its
        start-up's success, so one that crash-loops in a long start-up never has."""
        since = self._heartbeats.serving_since(index)
        return since is not None and self._clock() - since >= STABLE_AFTER_S

    def died(self, index: int) -> bool:
        """Front end `index` just died: whether it had served stable (its restart backoff
        starts over, and so does its count); else it counts one more."""
        self._died_serving_since[index] = self._heartbeats.serving_since(index)
        if self.served_stable(index):
            self._unstable[index] = 0
            return True
        self._unstable[index] = self._unstable.get(index, 0) + 1
        return False

    def _out_of_its_loop(self, index: int) -> bool:
        """Whether the process now front end `index`, not one counted dead, has served
        `STABLE_AFTER_S` (one that stopped with the server still counts)."""
        counted = index in self._died_serving_since
        if counted and self._died_serving_since[index] == self._heartbeats.serving_since(index):
            return False  # dead, its replacement not serving yet
        return self.served_stable(index)

    def problem(self, count: int) -> str | None:
        """Why the pod should be restarted: every one of its `count` front ends keeps dying
        before it has served for `STABLE_AFTER_S`; None otherwise."""
        restarts = (
            0 if self._out_of_its_loop(index) else self._unstable.get(index, 0)
            for index in range(count)
        )
        least = min(restarts, default=0)
        return crash_loop(least, "every front end", f"serving for {STABLE_AFTER_S:g} s")
