"""Dead processes' metric files folded into one archive per type (multiprocess mode).

prometheus_client writes one file per process and metric type into the multiprocess
directory, and every /metrics scrape parses all of them. Counters and histograms of a dead
process must stay counted (a counter that drops reads as a reset to Prometheus), so the
library never deletes them: a front end that crash-loops left thousands of files a day for
every scrape to read. `compact_dead_process` folds a dead process's counter, histogram and
summary values into `<type>_archive.db` (the library's own file format, so its collector
merges the archive like any process's file) and deletes the process's files; its live-mode
gauges are dropped as `mark_process_dead` does. The archive's disk space is allocated before
it is written, so a full disk fails the fold with ENOSPC, not the supervisor with SIGBUS; a
fold that fails leaves the archive and the dead process's files as they were (still
counted), drops its gauges all the same, and is logged (`forget_dead_process`).

Folding and scraping exclude each other through an advisory lock on a file in the directory:
a scrape (`scrape_lock`, shared) never sees a value both in the archive and in the file it
came from, nor in neither. Any process may call either; both block while the other runs
(a fold takes milliseconds; a scrape as long as its merge).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
from collections.abc import Iterator

from prometheus_client import multiprocess
from prometheus_client.mmap_dict import MmapedDict

log = logging.getLogger(__name__)

# Where prometheus_client's multiprocess mode keeps every process's files (set by `serve`).
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# The metric types whose values of every process add up (gauges combine by their mode and
# die with their process instead).
FOLDED_TYPES = ("counter", "histogram", "summary")
ARCHIVE_PID = "archive"
_LOCK_NAME = ".compaction.lock"


@contextlib.contextmanager
def _locked(directory: str, operation: int) -> Iterator[None]:
    fd = os.open(os.path.join(directory, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, operation)
        yield
    finally:
        os.close(fd)  # releases the lock


def scrape_lock(directory: str) -> contextlib.AbstractContextManager[None]:
    """Held (shared) while a scrape lists and reads the directory's files."""
    return _locked(directory, fcntl.LOCK_SH)


def archive_path(directory: str, metric_type: str) -> str:
    # `<type>_<pid>.db`, as the library names a process's file: its collector reads the
    # type from the name.
    return os.path.join(directory, f"{metric_type}_{ARCHIVE_PID}.db")


def compact_dead_process(directory: str, pid: int) -> None:
    """Fold the files of process `pid`, which must be dead (a live one would go on writing
    to a deleted file, its later values lost), into the archives; drop its live gauges.
    The merged value of every counter and histogram series is the same before and after."""
    with _locked(directory, fcntl.LOCK_EX):
        try:
            for metric_type in FOLDED_TYPES:
                dead = os.path.join(directory, f"{metric_type}_{pid}.db")
                if os.path.exists(dead):
                    _fold(directory, metric_type, dead)
        finally:
            # Also when a fold failed: a dead process's in-flight requests and queue depth
            # must not stay on /metrics (its unfolded files stay, still counted).
            multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


def _fold(directory: str, metric_type: str, dead: str) -> None:
    """Raises OSError (the disk full: ENOSPC) with the archive and `dead` left as they were."""
    archive = archive_path(directory, metric_type)
    totals: dict[str, float] = {}
    for path in (archive, dead):
        with contextlib.suppress(FileNotFoundError):
            for key, value, _timestamp, _position in _values_of(path):
                totals[key] = totals.get(key, 0.0) + value
    # Not `*.db`: a scrape never lists the half-written file. Removed first: the library's
    # writer opens a file to append to it, and would keep an earlier failed fold's values.
    temporary = archive + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.remove(temporary)
    try:
        _reserve(temporary, _archive_bytes(totals))
        written = MmapedDict(temporary)  # type: ignore[no-untyped-call]
        try:
            for key, value in totals.items():
                written.write_value(key, value, 0.0)  # type: ignore[no-untyped-call]
        finally:
            written.close()  # type: ignore[no-untyped-call]
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)  # gives back what was reserved
        raise
    os.replace(temporary, archive)
    os.remove(dead)


def _archive_bytes(totals: dict[str, float]) -> int:
    """The bytes the library's writer fills with `totals` (its format: a used count and
    padding, then per key its length, the key padded to 8 bytes, value and timestamp),
    rounded up to whole pages: the file it maps is never grown."""
    used = 8
    for key in totals:
        length = len(key.encode("utf-8"))
        used += 4 + length + (8 - (length + 4) % 8) + 16
    return -(-used // mmap.PAGESIZE) * mmap.PAGESIZE


def _reserve(path: str, size: int) -> None:
    """Create `path` with `size` bytes allocated on disk. The library's writer grows a new
    file sparsely (truncate) and writes it through mmap: on a full disk a write to a page
    with no block behind it raises SIGBUS, which killed the supervisor (and every child
    with it); allocated first, the file is mapped as it is, and a full disk is an OSError
    (ENOSPC) here."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)  # as the library creates it
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def _values_of(path: str) -> Iterator[tuple[str, float, float, int]]:
    # A file created but not yet sized (the library does that in two steps) holds nothing.
    if os.path.getsize(path) < 8:
        return iter(())
    values: Iterator[tuple[str, float, float, int]] = MmapedDict.read_all_values_from_file(path)  # type: ignore[no-untyped-call]
    return values


async def forget_dead_process(pid: int) -> None:
    """Drop a dead process's live gauges; fold its counters and histograms into the archives
    (`compact_dead_process`), in a thread: the fold waits for scrapes in progress. Nothing
    outside multiprocess mode. Never raises but for its cancellation: a fold that fails (a
    full disk, a file the library finds corrupted) is logged with its traceback, its files
    left counted where they are, and the supervisor goes on restarting the process (a front
    end's restart loop awaits this). Event loop thread (the supervisor's)."""
    directory = os.environ.get(MULTIPROCESS_DIR_ENV)
    if directory:
        try:
            await asyncio.to_thread(compact_dead_process, directory, pid)
        except Exception:
            log.exception("could not fold the metrics of dead process %d", pid)
