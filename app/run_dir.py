"""The run directory of one `steadyserve serve` supervisor (its engine's IPC sockets, the
processes' metrics files), and the removal of those whose supervisor died without removing
its own (SIGKILL, the OOM killer, a container restart: in a pod's emptyDir they piled up).

Each holds an `owner.lock` its supervisor keeps an exclusive flock on for its whole life.
The kernel releases a dead process's flocks however it died, so a lock nobody holds is a
dead owner's. A recorded pid alone could not tell: the supervisor is pid 1 of its container,
and so is the one that replaces it; a lock also holds across pid namespaces (two containers
sharing one emptyDir). The pid is written in the lock file for the log only.

Supervisor process, before its children start (`app/processes.py`); no threads.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

RUN_DIR_PREFIX = "steadyserve-"
OWNER_LOCK = "owner.lock"
# Where the lock is made and locked before it is renamed to OWNER_LOCK: a sweeper never sees
# an OWNER_LOCK its live owner does not hold yet.
_OWNER_LOCK_UNLOCKED = ".owner.lock.new"


@contextlib.contextmanager
def run_directory(parent: Path | None = None) -> Iterator[Path]:
    """A fresh run directory under `parent` (the temp directory by default), locked by this
    process until the block ends, then removed. Stale ones of dead supervisors there are
    removed first (`remove_stale_run_directories`)."""
    parent = Path(tempfile.gettempdir()) if parent is None else parent
    remove_stale_run_directories(parent)
    run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=parent))
    lock = _hold_owner_lock(run_dir)
    try:
        yield run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if lock is not None:
            os.close(lock)  # after the removal: no sweeper takes it half removed


def _hold_owner_lock(run_dir: Path) -> int | None:
    """The descriptor holding `run_dir`'s owner lock; None where the file system has no
    flock (the directory is then never swept: a warning, not a server that cannot start)."""
    unlocked = run_dir / _OWNER_LOCK_UNLOCKED
    # Not inherited by the children (PEP 446): the lock is released when this process dies.
    descriptor = os.open(unlocked, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        os.rename(unlocked, run_dir / OWNER_LOCK)
    except OSError as error:
        os.close(descriptor)
        unlocked.unlink(missing_ok=True)
        log.warning("%s cannot be locked (%s): it stays if this process is killed", run_dir, error)
        return None
    return descriptor


def remove_stale_run_directories(parent: Path) -> list[Path]:
    """Remove the run directories under `parent` whose supervisor died without removing
    them; returns them. Only directories this module made (named `steadyserve-*`, not a
    link, this user's, with an `owner.lock`) whose lock nobody holds: anything else, a live
    supervisor's or one still being made, is left alone."""
    removed = []
    for candidate in sorted(parent.glob(f"{RUN_DIR_PREFIX}*")):
        with contextlib.suppress(OSError):
            if _remove_if_stale(candidate):
                removed.append(candidate)
    return removed


def _remove_if_stale(candidate: Path) -> bool:
    if candidate.is_symlink() or not candidate.is_dir() or candidate.stat().st_uid != os.getuid():
        return False
    try:
        lock = os.open(candidate / OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # not a run directory of this layout
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its supervisor lives
        if os.fstat(lock).st_nlink == 0:
            return False  # removed meanwhile (by its owner, or another sweeper)
        owner = os.read(lock, 32).decode(errors="replace").strip() or "?"
        log.warning("removing %s: supervisor %s died without removing it", candidate, owner)
        shutil.rmtree(candidate, ignore_errors=True)
        return True
    finally:
        os.close(lock)
