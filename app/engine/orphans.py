"""No child left running without the supervisor that started it.

Called first thing in every child the supervisor spawns (the engine, each front end), on
that child's main thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this child if its parent (`parent_pid`, the supervisor that
    spawned it, passed by the supervisor) dies, even by kill -9; exit at once if it is
    already gone. The parent is named rather than assumed not to be PID 1: in a container
    the supervisor is PID 1 (the image's entry point), and a child reading its parent as
    PID 1 "died before the request took effect" exited at start, every engine and front
    end, forever."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        log.warning("cannot ask to die with the parent on this platform")
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)
