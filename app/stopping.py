"""How `steadyserve serve`'s supervisor (`app/processes.py`) ends its children: the front
ends' drain within one deadline, and killing them all at once. The supervisor's event loop
thread; each process is its own child, signalled by its pid.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable
from multiprocessing.process import BaseProcess

from app.frontend_process import DRAIN_OR_STOP, drained

# How long a killed child is waited for (its exit after SIGKILL takes the kernel moments).
REAP_S = 5.0


async def drain_frontends(frontends: list[BaseProcess], give_up_at: float) -> None:
    """Ask every front end to drain, then wait for each until `give_up_at` (on
    `time.monotonic`), killing any still running then."""
    for process in frontends:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, DRAIN_OR_STOP)
    # One deadline for all of them, not a fresh one per front end (k hung front ends
    # took k times as long).
    for process in frontends:
        await asyncio.to_thread(process.join, max(0.0, give_up_at - time.monotonic()))
        if process.is_alive():
            process.kill()
            await asyncio.to_thread(process.join, REAP_S)


def kill_now(processes: Iterable[BaseProcess | None], reap: bool) -> None:
    """SIGKILL each of `processes` still alive; with `reap`, wait up to `REAP_S` for each
    to exit (blocking: the supervisor is on its way out)."""
    for process in processes:
        if process is not None and process.is_alive():
            process.kill()
            if reap:
                process.join(REAP_S)


def drained_all(frontends: Iterable[BaseProcess]) -> bool:
    """Whether every front end ended as a drain asks it to (`frontend_process.drained`)."""
    return all(drained(process.exitcode) for process in frontends)
